//! A worker-side throughput check (ignored by default; run with
//! `cargo test -p forkfleet-worker --release -- --ignored --nocapture fan_out`):
//! 1,000 branches x 10 `write_file` calls through the LocalBus, events consumed and acked.

use super::common::*;
use forkfleet_shared::event::Event;
use forkfleet_shared::state::BranchState;
use std::fmt::Write as _;
use std::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn fan_out_1000_by_10() {
    let (n, k) = (1000u32, 10u32);
    let fx = Fixture::new().await;
    let (_, snap) = fx.snapshot(&[("README.md", "parent\n")]);
    let mut script =
        String::from("[defaults]\nusage = { input_tokens = 1000, output_tokens = 200 }\n");
    for b in 0..n {
        for j in 0..k {
            let _ = write!(
                script,
                "\n[[turns.b{b}]]\ntool_calls = [{{ name = \"write_file\", args = {{ path = \"unique/b{b}/f{j}.txt\", content = \"line of {b}/{j}\\n\" }} }}]\n"
            );
        }
        let _ = write!(script, "\n[[turns.b{b}]]\ntext = \"finished\"\n");
    }
    let script = fx.script(&script);
    let tasks: Vec<_> = (0..n)
        .map(|i| fx.task(&format!("b{i}"), i, snap, script))
        .collect();
    let mut events = fx.events().await;
    let a = start(&fx, config(64)).await;
    let b = start(&fx, config(64)).await;
    let t0 = Instant::now();
    for t in &tasks {
        fx.enqueue(t).await;
    }
    let mut done = 0;
    let mut count = 0usize;
    while done < n {
        let ev = events.next_raw().await;
        count += 1;
        if let Event::Status { state, .. } = ev.event {
            if state.is_terminal() {
                assert_eq!(state, BranchState::Done);
                done += 1;
            }
        }
    }
    let elapsed = t0.elapsed();
    println!("{n} branches x {k} writes: {count} events in {elapsed:?}");
    shutdown(a).await;
    shutdown(b).await;
}
