//! Child processes: echo the command line, stream the output, name the command on failure.

use std::{
    env,
    ffi::OsStr,
    iter,
    path::Path,
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};

/// The workspace root: xtask lives one directory below it.
pub fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask's manifest directory has a parent")
}

/// A `cargo` command in the workspace root, using the cargo that runs xtask so the toolchain
/// stays the same.
pub fn cargo() -> Command {
    let mut cmd = Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

/// Shell-like rendering of a command, with the environment variables it sets.
pub fn display(cmd: &Command) -> String {
    let envs = cmd
        .get_envs()
        .filter_map(|(key, value)| Some(format!("{}={}", key.display(), quote(value?))));
    let words = iter::once(quote(cmd.get_program())).chain(cmd.get_args().map(quote));
    envs.chain(words).collect::<Vec<_>>().join(" ")
}

fn quote(word: &OsStr) -> String {
    let word = word.to_string_lossy();
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./=:@+,%".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        word.into_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// Prints and runs `cmd` with inherited stdio; fails unless it exits successfully.
pub fn run(cmd: &mut Command) -> Result<()> {
    let shown = display(cmd);
    println!("$ {shown}");
    let status = cmd
        .status()
        .with_context(|| format!("could not start `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}

/// Runs a quick check silently and returns its stdout; fails unless it exits successfully.
pub fn probe(cmd: &mut Command) -> Result<String> {
    let shown = display(cmd);
    let output = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("could not start `{shown}`"))?;
    if !output.status.success() {
        bail!(
            "`{shown}` failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}
