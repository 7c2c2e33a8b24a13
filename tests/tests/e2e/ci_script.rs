//! CI runs the README's test command the way a newcomer does: first, before anything else
//! builds. Twice a test passed in CI and failed on every fresh clone because `.ci/run` built
//! the workspace's binaries (and the tools) before it ran the tests (issue 53); these tests
//! fail when `.ci/run` drifts from README.md again.

use std::path::Path;

fn repo_file(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("reading {}: {e}", full.display()))
}

/// The one command of README.md's "Test it" section (its first `sh` block).
fn readme_test_command(readme: &str) -> Result<String, String> {
    let section = readme.split("\n## Test it\n").nth(1).ok_or("README.md has no \"## Test it\" section")?;
    let section = section.split("\n## ").next().unwrap_or(section);
    let block = section.split("```sh\n").nth(1).ok_or("the \"Test it\" section has no ```sh block")?;
    let block = block.split("```").next().unwrap_or(block);
    let commands: Vec<&str> = block.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
    match commands.as_slice() {
        [one] => Ok((*one).to_string()),
        other => Err(format!("the \"Test it\" block holds {} commands, not one: {other:?}", other.len())),
    }
}

/// Whether a line of the CI script builds, installs a tool or runs something built: what must
/// not come before the README's test command.
fn builds(line: &str) -> bool {
    const MARKS: [&str; 10] =
        ["cargo ", "setup.sh", "build.py", "release.sh", "./target/", "go ", "npm ", "buf ", "make ", "$KUBEBUILDER_ASSETS"];
    MARKS.iter().any(|m| line.contains(m))
}

/// The commands of one shell line: split at `;`, `&&`, `||` and `|` outside quotes, each
/// trimmed of the braces and keywords that open a block.
fn commands(line: &str) -> Vec<String> {
    let (mut out, mut current, mut quote) = (Vec::new(), String::new(), None::<char>);
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (None, '\'' | '"') => quote = Some(c),
            (None, ';' | '&' | '|') => {
                out.push(std::mem::take(&mut current));
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    out.push(current);
    out.into_iter()
        .map(|c| {
            let mut c = c.trim();
            loop {
                let before = c;
                for opener in ["(", "{", "!", "if ", "then ", "do ", "else "] {
                    c = c.strip_prefix(opener).unwrap_or(c).trim_start();
                }
                if c == before {
                    break;
                }
            }
            c.to_string()
        })
        .filter(|c| !c.is_empty())
        .collect()
}

/// Whether a command only reports or checks for a tool: a message, a step title, `command -v`,
/// the Rust toolchain's own components and targets.
fn harmless(command: &str) -> bool {
    ["command -v ", "rustup component ", "rustup target ", "echo ", "echo", "step "].iter().any(|p| command.starts_with(p))
}

/// Checks that the first command of `script` that builds anything runs exactly `command` (its
/// output may be piped or redirected, nothing else).
fn check(script: &str, command: &str) -> Result<(), String> {
    let first = script
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .flat_map(commands)
        .find(|c| !harmless(c) && builds(c))
        .ok_or_else(|| format!("the CI script never runs the README's test command `{command}`"))?;
    let rest = first.strip_prefix(command).ok_or_else(|| {
        format!("the CI script's first build is `{first}`, not the README's test command `{command}`: run the tests first")
    })?;
    let rest = rest.trim_start();
    if rest.is_empty() || rest.starts_with("2>") || rest.starts_with('>') {
        Ok(())
    } else {
        Err(format!("the CI script runs `{first}`, not the README's test command `{command}` as it stands"))
    }
}

#[test]
fn ci_runs_the_readme_test_command_first() {
    let command = readme_test_command(&repo_file("README.md")).expect("README.md's test command");
    assert_eq!(command, "cargo test --workspace", "README.md's test command (a change here is a change to the product)");
    check(&repo_file(".ci/run"), &command).expect("the CI script");
}

#[test]
fn a_ci_script_that_builds_first_or_changes_the_command_is_refused() {
    let cmd = "cargo test --workspace";
    // The order that hid issue 53: the binaries and the tools built before the tests.
    let built_first = "step \"tools\"\ncommand -v cargo >/dev/null || exit 1\nrustup target add x86_64-unknown-linux-musl\n\
        KUBEBUILDER_ASSETS=$(bash harness/envtest/setup.sh)\ncargo build --workspace --bins --examples\ncargo test --workspace\n";
    assert!(check(built_first, cmd).expect_err("the tools built first").contains("setup.sh"));
    let bins_first = "cargo build --workspace --bins\ncargo test --workspace 2>&1 | tee log\n";
    assert!(check(bins_first, cmd).is_err());
    let other_flags = "cargo test --workspace --no-fail-fast\n";
    assert!(check(other_flags, cmd).is_err());
    let other_package = "cargo test -p ccm-e2e\n";
    assert!(check(other_package, cmd).is_err());
    assert!(check("echo \"cargo test --workspace\"\n", cmd).is_err());
    // A build hidden behind a harmless-looking check or the toolchain's own runner.
    let behind_a_check = "command -v cargo >/dev/null && cargo build --workspace --bins\ncargo test --workspace\n";
    assert!(check(behind_a_check, cmd).expect_err("hidden build").contains("cargo build"));
    let through_rustup = "rustup run stable cargo build --workspace --bins\ncargo test --workspace\n";
    assert!(check(through_rustup, cmd).is_err());
    let in_a_block = "if true; then cargo build --workspace; fi\ncargo test --workspace\n";
    assert!(check(in_a_block, cmd).is_err());
    // What CI does now.
    let ok = "step \"tools\"\ncommand -v go >/dev/null || { echo \"go is required\"; exit 1; }\n# cargo build first? no\n\
        cargo test --workspace 2>&1 | tee \"$work/tests.log\"\nbash harness/envtest/setup.sh helm\n";
    assert_eq!(check(ok, cmd), Ok(()));
}

#[test]
fn the_readme_test_command_is_read_from_its_section() {
    let readme =
        "# x\n## Run it\n```sh\ncargo run -p q\n```\n## Test it\n\n```sh\ncargo test --workspace\n```\n\ntext\n## Next\n";
    assert_eq!(readme_test_command(readme), Ok("cargo test --workspace".into()));
    let two = "## Test it\n```sh\ncargo build\ncargo test\n```\n";
    assert!(readme_test_command(two).is_err());
    assert!(readme_test_command("## Run it\n```sh\ncargo run\n```\n").is_err());
}
