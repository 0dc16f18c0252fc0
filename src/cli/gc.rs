//! `forkfleet gc` and `fork rm`: deleting finished forks and the blobs nothing refers to.

use super::*;
use forkfleet_shared::api::GcReport;

#[derive(Debug, Args)]
pub struct GcArgs {
    /// Delete merged and aborted forks created at least this long ago: a number and a
    /// unit, `s`, `m`, `h` or `d` (`30d`, `12h`, `0s` for any age).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub older_than: Duration,
    /// Say what would be deleted; delete nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Keep blobs stored more recently than this (an upload for a fork being created at
    /// the same moment); default 10m.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub grace: Option<Duration>,
    #[command(flatten)]
    pub client: ClientArgs,
}

/// `30d`, `12h`, `90m`, `3600s` (a bare number is seconds).
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let (num, unit) = t.split_at(t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len()));
    let n: u64 = num.parse().map_err(|_| {
        format!("`{s}` is not a duration: a number and a unit, s, m, h or d (e.g. 30d)")
    })?;
    let secs = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        other => {
            return Err(format!(
                "`{s}`: unknown unit `{other}`; valid: s, m, h, d (e.g. 30d)"
            ))
        }
    };
    Ok(Duration::from_secs(n.saturating_mul(secs)))
}

pub(crate) async fn cmd_gc(args: GcArgs) -> anyhow::Result<()> {
    let GcArgs {
        older_than,
        dry_run,
        grace,
        client,
    } = args;
    with_session!(&client, Local::Read, |coord| async {
        let report = coord
            .gc(
                Some(older_than.as_millis() as u64),
                dry_run,
                grace.map(|g| g.as_millis() as u64),
            )
            .await?;
        finish(&report, client.json)
    })
}

/// `fork rm FORK`.
pub(crate) async fn cmd_remove(
    fork: &str,
    dry_run: bool,
    client: &ClientArgs,
) -> anyhow::Result<()> {
    with_session!(client, Local::Read, |coord| async {
        let id = coord.find_fork(fork).await?;
        let report = coord.remove_fork(id, dry_run).await?;
        finish(&report, client.json)
    })
}

/// Remove the deleted forks' directories on this machine, then print the report.
fn finish(report: &GcReport, json: bool) -> anyhow::Result<()> {
    let mut dirs = Vec::new();
    if !report.dry_run {
        for (fork, ws) in &report.workspaces {
            match forkdir::remove_fork_dir(ws, *fork) {
                Ok(forkdir::Cleanup::Removed(dir)) => dirs.push(dir.display().to_string()),
                Ok(_) => {}
                Err(e) => forkfleet_client::render::say(&format!(
                    "warning: the fork directory of {fork} was not removed: {}",
                    render::error_chain(&e)
                )),
            }
        }
    }
    if json {
        let mut doc = render::to_json(report)?;
        doc["fork_dirs_removed"] = serde_json::json!(dirs);
        return print_json(&doc);
    }
    let verb = if report.dry_run {
        "would delete"
    } else {
        "deleted"
    };
    println!(
        "{verb} {} ({} runs, {} events, {} checkpoints) and {} no longer referenced ({})",
        render::count(report.removed.len(), "fork", "forks"),
        report.runs,
        report.events,
        report.checkpoints,
        render::count(report.blobs, "blob", "blobs"),
        forkfleet_shared::scan::human_bytes(report.blob_bytes)
    );
    if report.bus_blobs > 0 {
        println!(
            "and {} from the bus's buckets",
            render::count(report.bus_blobs, "blob", "blobs")
        );
    }
    for f in &report.removed {
        println!("  {f}");
    }
    for d in &dirs {
        println!("  removed {d}");
    }
    for k in &report.kept {
        println!("kept {}: {}", k.fork_id, k.why);
    }
    Ok(())
}
