//! Helpers: a copy of the quickstart example in a temporary directory, and the binary.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub struct Example {
    pub dir: tempfile::TempDir,
}

impl Example {
    /// A fresh copy of `examples/quickstart` (spec, script and workspace).
    pub fn quickstart() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/quickstart");
        copy_dir(&src, dir.path());
        Self { dir }
    }

    pub fn spec(&self) -> PathBuf {
        self.dir.path().join("fork.toml")
    }

    pub fn workspace(&self) -> PathBuf {
        self.dir.path().join("workspace")
    }

    pub fn data(&self) -> PathBuf {
        self.dir.path().join(".forkfleet")
    }

    pub fn read(&self, rel: &str) -> Option<String> {
        std::fs::read_to_string(self.workspace().join(rel)).ok()
    }

    pub fn write_spec(&self, text: &str) -> PathBuf {
        let p = self.dir.path().join("custom.toml");
        std::fs::write(&p, text).unwrap();
        p
    }
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        if name == ".forkfleet" {
            continue;
        }
        let to = dst.join(&name);
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &to);
        } else {
            std::fs::copy(entry.path(), &to).unwrap();
        }
    }
}

/// Run the binary with `args`; bounded by a generous timeout through the fork commands'
/// own `--timeout-s` where they wait.
pub fn forkfleet(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_forkfleet"))
        .args(args)
        .env_remove("FORKFLEET_DATA")
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

pub fn json(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

pub fn path_str(p: &Path) -> &str {
    p.to_str().unwrap()
}
