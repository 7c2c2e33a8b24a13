//! `--version`, as upstream's (`k8s.io/component-base/version/verflag`): `--version` prints
//! `Kubernetes v1.37.2` (the Kubernetes release this core is built and tested against, whose
//! `k8s.io/cloud-provider` behaviour it follows) followed by ours and the commit;
//! `--version=raw` prints every field as Go's `%#v` of `version.Info`; `--version=false` runs;
//! `--version=vX.Y.Z` makes that the version reported.

/// The Kubernetes release this core follows: the `k8s.io/cloud-provider` the go-adapter pins
/// and the control plane the tests run (a test keeps the three equal).
pub const KUBERNETES: &str = "v1.37.2";

/// This core's own version and commit: `0.1.0 (commit 0123456789ab)`.
pub const OURS: &str = env!("CCM_VERSION");

/// What `--version=…` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Print the version line and exit.
    Print,
    /// Print every field and exit.
    Raw,
    /// Run, reporting this version.
    Report(String),
    /// Run.
    Run,
}

/// Reads `--version`'s value as pflag's verflag does.
pub fn request(value: Option<&str>) -> Result<Request, String> {
    let Some(value) = value else { return Ok(Request::Run) };
    match value {
        "raw" => Ok(Request::Raw),
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(Request::Print),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(Request::Run),
        v if v.starts_with('v') && semver_like(&v[1..]) => Ok(Request::Report(v.to_string())),
        other => Err(format!("--version={other}: expected true, false, raw or vX.Y.Z")),
    }
}

fn semver_like(v: &str) -> bool {
    let core = v.split(['-', '+']).next().unwrap_or_default();
    let parts: Vec<&str> = core.split('.').collect();
    parts.len() == 3 && parts.iter().all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()))
}

/// The line `--version` prints: `Kubernetes v1.37.2 (ccm-rs 0.1.0 (commit …))`.
pub fn line(reported: Option<&str>) -> String {
    format!("Kubernetes {} (ccm-rs {OURS})", reported.unwrap_or(KUBERNETES))
}

/// What `--version=raw` prints, field by field as upstream's `version.Info`.
pub fn raw(reported: Option<&str>) -> String {
    let git_version = reported.unwrap_or(KUBERNETES);
    let numbers: Vec<&str> = git_version.trim_start_matches('v').split(['.', '-', '+']).collect();
    let (major, minor) = (numbers.first().copied().unwrap_or_default(), numbers.get(1).copied().unwrap_or_default());
    let build_date = env!("CCM_BUILD_EPOCH")
        .parse::<i64>()
        .ok()
        .and_then(|s| jiff::Timestamp::from_second(s).ok())
        .map(|t| t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string())
        .unwrap_or_else(|| "1970-01-01T00:00:00Z".into());
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    format!(
        "version.Info{{Major:{major:?}, Minor:{minor:?}, EmulationMajor:\"\", EmulationMinor:\"\", \
         MinCompatibilityMajor:\"\", MinCompatibilityMinor:\"\", GitVersion:{git_version:?}, GitCommit:{commit:?}, \
         GitTreeState:\"\", BuildDate:{build_date:?}, GoVersion:\"\", Compiler:\"rustc\", Platform:\"{os}/{arch}\", \
         CcmRsVersion:{ours:?}}}",
        commit = env!("CCM_GIT_COMMIT"),
        os = std::env::consts::OS,
        ours = env!("CARGO_PKG_VERSION"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_read_as_verflag_reads_them() {
        assert_eq!(request(None), Ok(Request::Run));
        assert_eq!(request(Some("true")), Ok(Request::Print));
        assert_eq!(request(Some("raw")), Ok(Request::Raw));
        assert_eq!(request(Some("false")), Ok(Request::Run));
        assert_eq!(request(Some("v1.38.0")), Ok(Request::Report("v1.38.0".into())));
        assert_eq!(request(Some("v1.38.0-rc.1+abc")), Ok(Request::Report("v1.38.0-rc.1+abc".into())));
        assert!(request(Some("yes")).is_err());
        assert!(request(Some("v1.x")).is_err());
    }

    #[test]
    fn the_line_and_the_raw_form_are_upstreams() {
        assert!(line(None).starts_with("Kubernetes v1.37.2 (ccm-rs 0.1.0 (commit "), "{}", line(None));
        assert!(line(Some("v1.38.1")).starts_with("Kubernetes v1.38.1 "));
        let raw = raw(None);
        assert!(raw.starts_with(r#"version.Info{Major:"1", Minor:"37", EmulationMajor:"", "#), "{raw}");
        assert!(raw.contains(r#"GitVersion:"v1.37.2", GitCommit:""#), "{raw}");
        assert!(raw.contains(r#"Platform:"linux/"#), "{raw}");
    }

    /// The release named here is the one the go-adapter pins (`k8s.io/cloud-provider v0.37.2`
    /// is Kubernetes v1.37.2) and the one the tests' control plane is built from.
    #[test]
    fn the_kubernetes_release_is_the_pinned_one() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
        let go_mod = std::fs::read_to_string(format!("{root}/providers/go-adapter/go.mod")).expect("go.mod");
        let pinned = go_mod
            .lines()
            .find_map(|l| l.trim().strip_prefix("k8s.io/cloud-provider "))
            .map(|v| v.trim().replacen("v0.", "v1.", 1))
            .expect("k8s.io/cloud-provider in go.mod");
        assert_eq!(pinned, KUBERNETES);
        let harness = std::fs::read_to_string(format!("{root}/harness/envtest/go.mod")).expect("harness go.mod");
        let built = harness.lines().find_map(|l| l.trim().strip_prefix("k8s.io/kubernetes ")).map(str::trim);
        assert_eq!(built, Some(KUBERNETES), "harness/envtest/go.mod builds another Kubernetes");
    }
}
