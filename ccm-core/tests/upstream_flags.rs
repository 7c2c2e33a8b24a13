//! An existing deployment's arguments start this core: every flag of upstream's
//! cloud-controller-manager (its --help, `data/upstream-flags.txt`) is accepted or refused with
//! one sentence that names it and says what to do, never "unexpected argument"; and the full
//! argument lists of the AWS, GCP, Azure, OpenStack and hcloud charts (`data/charts/`, each
//! naming its source) are run through the binary as a user runs it.

use std::process::Command;

fn data(path: &str) -> String {
    std::fs::read_to_string(format!("{}/tests/data/{path}", env!("CARGO_MANIFEST_DIR"))).expect("test data")
}

fn lines(text: &str) -> Vec<String> {
    text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(str::to_string).collect()
}

/// A value of the flag's type that upstream would take.
fn sample(flag: &str, kind: &str) -> Option<String> {
    let special = match flag {
        "--controllers" => "*",
        "--cluster-cidr" => "10.244.0.0/16",
        "--cloud-provider" => "external",
        "--cidr-allocator-type" => "RangeAllocator",
        "--leader-elect-resource-lock" => "leases",
        "--logging-format" => "json",
        "--kube-api-content-type" => "application/json",
        "--tls-min-version" | "--webhook-tls-min-version" => "VersionTLS12",
        "--secure-port" => "10258",
        "--leader-elect-lease-duration" => "20s",
        "--webhook-secure-port" => "0",
        "--authorization-always-allow-paths" => "/healthz,/metrics",
        "--feature-gates" => "CloudControllerManagerWatchBasedRoutesReconciliation=true",
        _ => "",
    };
    if !special.is_empty() {
        return Some(special.into());
    }
    Some(
        match kind {
            "" => "true",
            "int" => "2",
            "float" => "20",
            "duration" => "10s",
            "ip" => "127.0.0.1",
            "Level" => "2",
            "pattern" => "route=4",
            "quantity" => "0",
            "mapStringBool" => "WatchList=true",
            "namedCertKey" => "a.crt,a.key",
            "version" => return None,
            _ => "/etc/kubernetes/value",
        }
        .into(),
    )
}

/// The binary's verdict on `args`: accepted (ok), or its error text.
fn check(args: &[String]) -> Result<(), String> {
    let out = Command::new(env!("CARGO_BIN_EXE_cloud-controller-manager"))
        .args(args)
        .env("CCM_CHECK_ARGS", "1")
        .env_remove("KUBECONFIG")
        .output()
        .expect("run the binary");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if out.status.success() { Ok(()) } else { Err(text) }
}

#[test]
fn every_upstream_flag_is_accepted_or_refused_with_a_sentence() {
    let flags = lines(&data("upstream-flags.txt"));
    assert!(flags.len() > 80, "the list is upstream's whole --help");
    let (mut accepted, mut refused) = (Vec::new(), Vec::new());
    for line in &flags {
        let (flag, kind) = line.split_once(' ').unwrap_or((line.as_str(), ""));
        if flag == "--help" {
            continue;
        }
        let Some(value) = sample(flag, kind) else { continue };
        let arg = if kind.is_empty() { flag.to_string() } else { format!("{flag}={value}") };
        // Flags that come in pairs, as upstream's do.
        let mut args = vec![arg.clone()];
        match flag {
            "--tls-cert-file" => args.push("--tls-private-key-file=/etc/kubernetes/tls.key".into()),
            "--tls-private-key-file" => args.push("--tls-cert-file=/etc/kubernetes/tls.crt".into()),
            _ => {}
        }
        match check(&args) {
            Ok(()) => accepted.push(flag.to_string()),
            Err(text) => {
                assert!(!text.contains("unexpected argument"), "{arg}: not a flag here:\n{text}");
                let named = text.contains(flag) || text.contains(flag.trim_start_matches("--"));
                assert!(named && text.lines().count() <= 3, "{arg}: refused without a sentence naming it:\n{text}");
                refused.push(flag.to_string());
            }
        }
    }
    println!("{} upstream flags accepted, {} refused: {refused:?}", accepted.len(), refused.len());
    // What can be honoured is: only what this core cannot do is refused.
    for must in ["--cloud-provider", "--v", "--vmodule", "--feature-gates", "--authentication-kubeconfig", "--master"] {
        assert!(accepted.iter().any(|f| f == must), "{must} is refused");
    }
}

#[test]
fn chart_argument_lists_start_the_core_or_say_what_to_change() {
    for chart in ["aws", "gcp", "azure", "openstack", "hcloud"] {
        let args = lines(&data(&format!("charts/{chart}.args")));
        // Each flag on its own: accepted, or refused with a sentence naming it.
        let mut refused = Vec::new();
        for arg in &args {
            if let Err(text) = check(std::slice::from_ref(arg)) {
                let flag = arg.split('=').next().unwrap_or(arg);
                assert!(!text.contains("unexpected argument"), "{chart}: {arg} is not a flag here:\n{text}");
                assert!(text.contains(flag), "{chart}: {arg} refused without naming it:\n{text}");
                refused.push(flag.to_string());
            }
        }
        // The whole list: starts, once the refused flags (if any) are taken out.
        let kept: Vec<String> = args.iter().filter(|a| !refused.iter().any(|r| a.starts_with(r.as_str()))).cloned().collect();
        assert!(check(&kept).is_ok(), "{chart}: the list without {refused:?} is refused: {:?}", check(&kept));
        println!("{chart}: {} of {} flags accepted; refused: {refused:?}", kept.len(), args.len());
        // Every one of these charts' lists now runs unchanged (AWS's `--controllers=*,tagging`
        // and OpenStack's `--cloud-config` included).
        assert!(refused.is_empty(), "{chart}: {refused:?} refused");
    }
}

#[test]
fn klog_verbosity_sets_the_log_level() {
    // `-v=4` is debug: the binary starts logging at that level (it fails later for want of a
    // cluster, after its first debug line or its error).
    assert!(check(&["-v=4".into()]).is_ok());
    assert!(check(&["--v=2".into(), "--logging-format=json".into()]).is_ok());
    let refused = check(&["--feature-gates=NoSuchGate=true".into()]).expect_err("an unknown gate");
    assert!(refused.contains("NoSuchGate"), "{refused}");
}
