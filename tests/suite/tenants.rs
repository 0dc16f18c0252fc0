//! Blobs belong to tenants (ADR 36), on a real nats-server with the permissions `forkfleet
//! cluster auth` generated, a real coordinator (a 2 MB blob quota per identity) and
//! worker, and the clients `alice` and `bob`:
//!
//! - alice's fork runs from uploads in several parts, all through the coordinator;
//! - bob cannot list, read or write the blob buckets (the server refuses him), cannot read
//!   alice's file through the coordinator nor learn that it exists, cannot store bytes
//!   under a hash that is not theirs, and cannot upload past his quota (a clear error);
//! - content poisoned in the store before (an earlier release let clients write it) is
//!   repaired by the next upload, and the fork that needs it runs.

use super::harness::{path_str, Example};
use super::roles::{connect_as, Roles};
use bytes::Bytes;
use forkfleet_bus::nats::{NatsAuth, NatsBus, NatsConfig};
use forkfleet_bus::Bus;
use forkfleet_shared::blob::BlobHash;

/// A bus as client `who`, its blobs through the coordinator, as the CLI connects.
async fn client_bus(roles: &Roles, who: &str) -> NatsBus {
    let seed = std::fs::read_to_string(roles.auth.join(format!("client-{who}.nk"))).unwrap();
    let mut config = NatsConfig::new(roles.nats.url());
    config.auth = NatsAuth::NkeySeed(seed.trim().to_string());
    config.inbox_prefix = Some(format!("_INBOX_ff.client.{who}"));
    config.provision = false;
    config.blob_broker = Some(format!("client.{who}"));
    NatsBus::connect(config).await.unwrap()
}

/// Bytes no one else has, of `len`.
fn unique(tag: &str, len: usize) -> Vec<u8> {
    let seed = format!("{tag}-{}\n", uuid::Uuid::now_v7());
    seed.bytes().cycle().take(len).collect()
}

#[test]
fn tenants_cannot_list_read_overwrite_or_flood_each_others_blobs() {
    let roles = Roles::start_with("\n[coordinator]\nblob_quota_mb = 2\n");
    let ex = Example::quickstart();
    let secret = unique("alice's secret", 64);
    std::fs::write(ex.workspace().join("secret.txt"), &secret).unwrap();
    // Larger than one part: uploaded in three.
    let big = unique("alice's big file", 1_200_000);
    std::fs::write(ex.workspace().join("big.txt"), &big).unwrap();
    let a = roles.create("client-alice", &ex.spec());
    let watched = roles.watch("client-alice", &a);
    assert_eq!(watched["state"], "settled", "{watched}\n{}", roles.logs());
    for branch in watched["branches"].as_array().unwrap() {
        assert_eq!(branch["state"], "done", "{watched}\n{}", roles.logs());
    }
    let secret_hash = BlobHash::of(&secret);
    // A fork of bob's own, whose branch run his attempts below name.
    let theirs = roles.create("client-bob", &Example::quickstart().spec());
    let bob_run: forkfleet_shared::ids::RunId = roles.watch("client-bob", &theirs)["branches"][0]
        ["id"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let readme = std::fs::read(ex.workspace().join("README.md")).unwrap();
    let readme_hash = BlobHash::of(&readme);

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // Through the coordinator, alice reads her own; bob learns nothing of hers.
        let alice = client_bus(&roles, "alice").await;
        let got = alice.blobs().get(&BlobHash::of(&big)).await.unwrap();
        assert_eq!(got.as_deref(), Some(big.as_slice()), "read back in parts");
        let bob = client_bus(&roles, "bob").await;
        assert_eq!(bob.blobs().get(&secret_hash).await.unwrap(), None);
        assert_eq!(
            bob.blobs().missing(&[secret_hash]).await.unwrap(),
            vec![secret_hash],
            "bob is told to upload it, as if no one had"
        );
        // Bytes under another hash are refused; the stored copy stays right.
        let err = bob
            .blobs()
            .put(readme_hash, Bytes::from_static(b"poison"))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("hash to"), "{err}");
        let kept = alice.blobs().get(&readme_hash).await.unwrap();
        assert_eq!(kept.as_deref(), Some(readme.as_slice()));
        // Nor can he smuggle her hash into a fork of his own to read it back: a manifest
        // naming it, as an agent's snapshot (or a fork's), is refused.
        let mut stolen = forkfleet_shared::manifest::Manifest::default();
        stolen.insert_file(
            forkfleet_shared::path::WsPath::parse("stolen.txt").unwrap(),
            forkfleet_shared::manifest::FileEntry::for_bytes(&secret, 0o644),
        );
        let manifest = stolen.to_blob().unwrap();
        let manifest_hash = BlobHash::of(&manifest);
        bob.blobs().put(manifest_hash, manifest).await.unwrap();
        let api =
            forkfleet_client::Client::on_subject(std::sync::Arc::new(bob.clone()), "client.bob");
        let refused = forkfleet_client::ApiClient::agent_fork(
            &api,
            bob_run,
            0u64,
            manifest_hash,
            vec![forkfleet_shared::api::AgentBranch {
                label: "thief".into(),
                steer: "read stolen.txt".into(),
                model: None,
                budget_usd: None,
                extra_instructions: None,
            }],
            None,
            None,
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(refused.contains("has not uploaded"), "{refused}");

        // Proving he has the bytes (uploading them) makes them his too.
        bob.blobs()
            .put(secret_hash, Bytes::from(secret.clone()))
            .await
            .unwrap();
        assert!(bob
            .blobs()
            .missing(&[secret_hash])
            .await
            .unwrap()
            .is_empty());

        // A flood stops at his quota, with an error that says so.
        let mut refused = None;
        for i in 0..4 {
            let bytes = unique(&format!("flood {i}"), 900_000);
            if let Err(e) = bob.blobs().put(BlobHash::of(&bytes), bytes.into()).await {
                refused = Some((i, e.to_string()));
                break;
            }
        }
        let (at, err) = refused.expect("the quota never refused an upload");
        assert_eq!(at, 2, "two fit in 2 MB, the third does not: {err}");
        assert!(
            err.contains("`bob`'s blobs would pass its quota") && err.contains("blob_quota_mb"),
            "{err}"
        );

        // The buckets themselves are not his: the server refuses every way in.
        let mut raw = connect_as(
            &roles.nats.url(),
            &roles.auth,
            "client-bob",
            Some("_INBOX_ff.client.bob"),
        )
        .await;
        let key = secret_hash.to_hex();
        for (what, subject) in [
            (
                "publish",
                "$JS.API.STREAM.INFO.KV_ff_blobs_small".to_string(),
            ),
            (
                "publish",
                "$JS.API.DIRECT.GET.KV_ff_blobs_small".to_string(),
            ),
            ("publish", format!("$KV.ff_blobs_small.{key}")),
            ("publish", "$JS.API.STREAM.INFO.OBJ_ff_blobs".to_string()),
        ] {
            raw.client
                .publish(subject.clone(), "x".into())
                .await
                .unwrap();
            raw.client.flush().await.unwrap();
            raw.refused(what, &subject).await;
        }

        // Poison planted in the store (as an earlier release let any client do) is
        // repaired by the next upload of the real bytes.
        let victim = unique("a file someone poisoned", 300);
        let victim_hash = BlobHash::of(&victim);
        let admin_seed = std::fs::read_to_string(roles.auth.join("admin.nk")).unwrap();
        let mut direct = NatsConfig::new(roles.nats.url());
        direct.auth = NatsAuth::NkeySeed(admin_seed.trim().to_string());
        direct.provision = false;
        let admin = NatsBus::connect(direct).await.unwrap();
        admin
            .blobs()
            .put(victim_hash, Bytes::from_static(b"poisoned"))
            .await
            .unwrap();
        std::fs::write(ex.workspace().join("victim.txt"), &victim).unwrap();
    });
    let id = roles.create("client-alice", &ex.spec());
    let watched = roles.watch("client-alice", &id);
    for branch in watched["branches"].as_array().unwrap() {
        assert_eq!(branch["state"], "done", "{watched}\n{}", roles.logs());
    }
    assert!(
        roles.coordinator.log().contains("blobs.repair"),
        "{}",
        roles.logs()
    );

    // A fork past the quota is refused at upload, naming the quota; nothing is created.
    let over = Example::quickstart();
    std::fs::write(over.workspace().join("huge.bin"), unique("huge", 2_500_000)).unwrap();
    let before = roles.client("client-bob", &["fork", "ls", "--json"]).json();
    let refused = roles.client("client-bob", &["fork", "create", path_str(&over.spec())]);
    assert_ne!(refused.code, Some(0), "{}", refused.stdout);
    assert!(
        refused.stderr.contains("blob_quota_mb"),
        "{}",
        refused.stderr
    );
    let after = roles.client("client-bob", &["fork", "ls", "--json"]).json();
    assert_eq!(before, after);
    // What branches write counts too: past the quota, the fork's branches are stopped,
    // saying why (100 KB a turn, 100 turns, against alice's 2 MB).
    let flood = Example::quickstart();
    let content = format!("{{repeat}} {}", "y".repeat(100_000));
    std::fs::write(
        flood.dir.path().join("flood.toml"),
        super::harness::writes_then_done(50, true, "flood/{repeat}.txt", &content, 100),
    )
    .unwrap();
    let spec = flood.write_spec(
        "goal = \"flood\"\nworkspace = \"workspace\"\nmodel = \"scripted:flood\"\nmax_turns = 200\n\
         [models.\"scripted:flood\"]\nscript = \"flood.toml\"\n\
         price = { input_per_mtok = 0.15, output_per_mtok = 0.60 }\n",
    );
    let id = roles.create("client-alice", &spec);
    let watched = roles.watch("client-alice", &id);
    let branch = &watched["branches"][0];
    assert_eq!(branch["state"], "terminated", "{watched}\n{}", roles.logs());
    assert!(
        branch["error"]
            .as_str()
            .unwrap_or_default()
            .contains("passed its blob quota"),
        "{watched}"
    );
    // ... and nothing new runs for her account past it: not a follow-up of that branch,
    // nor a new fork.
    let label = branch["label"].as_str().unwrap();
    for args in [
        vec!["fork", "continue", id.as_str(), label, "more"],
        vec!["fork", "create", path_str(&ex.spec())],
    ] {
        let refused = roles.client("client-alice", &args);
        assert_ne!(refused.code, Some(0), "{args:?}");
        assert!(
            refused.stderr.contains("quota") && refused.stderr.contains("blob_quota_mb"),
            "{args:?}: {}",
            refused.stderr
        );
    }
    let log = roles.nats.log();
    // Only the raw attempts above were violations: the product needed none.
    assert!(
        !log.contains("Violation") || log.matches("Violation").count() == 4,
        "{log}"
    );
}

/// A client with an identity on an unrestricted cluster (it may create buckets, nobody
/// restricts it) still goes through the coordinator: its fork is created from its own
/// uploads and runs, and its account owns them.
#[test]
fn an_identity_on_an_unrestricted_cluster_uploads_through_the_coordinator() {
    use super::fleet::{Fleet, Options};
    let fleet = Fleet::start(1, 2, Options::default());
    let ex = Example::quickstart();
    let created = fleet.client(&[
        "fork",
        "create",
        path_str(&ex.spec()),
        "--identity",
        "carol",
        "--json",
    ]);
    assert_eq!(
        created.code,
        Some(0),
        "{}\n{}",
        created.stderr,
        fleet.logs()
    );
    let id = created.json()["fork_id"].as_str().unwrap().to_string();
    let watched = fleet
        .client(&[
            "fork",
            "watch",
            &id,
            "--identity",
            "carol",
            "--json",
            "--timeout-s",
            "60",
        ])
        .json();
    assert_eq!(watched["state"], "settled", "{watched}\n{}", fleet.logs());
    // (Uploaded straight into the buckets, the blobs would be no one's, and the fork
    // refused: "names blobs that client `carol` has not uploaded".)
    let cost = fleet
        .client(&["fork", "cost", &id, "--identity", "carol", "--json"])
        .json();
    assert_eq!(cost["account"]["name"], "carol", "{cost}");
}

/// A blob bucket at its `max_bytes` refuses more, saying which bucket and what to do (not
/// JetStream's bare "maximum bytes exceeded"); what it held stays readable.
#[test]
fn a_full_blob_bucket_says_so() {
    let server = forkfleet_bus::testkit::NatsServer::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut config = NatsConfig::new(server.url());
        config.blob_max_bytes = 1 << 20;
        let bus = NatsBus::connect(config).await.unwrap();
        let first = unique("first", 600_000);
        let first_hash = BlobHash::of(&first);
        bus.blobs()
            .put(first_hash, first.clone().into())
            .await
            .unwrap();
        let second = unique("second", 600_000);
        let err = bus
            .blobs()
            .put(BlobHash::of(&second), second.into())
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("the blob store is full: bucket `ff_blobs`")
                && err.contains("blob_store_mb"),
            "{err}"
        );
        let kept = bus.blobs().get(&first_hash).await.unwrap();
        assert_eq!(kept.as_deref(), Some(first.as_slice()));
    });
}

/// Commands of one identity uploading the same new file at once all make their forks
/// (their parts converge on one upload; none fails half-way).
#[test]
fn one_identity_uploading_the_same_file_at_once_succeeds() {
    let roles = Roles::start_with("\n[coordinator]\nblob_quota_mb = 100\n");
    let same = Example::quickstart();
    std::fs::write(
        same.workspace().join("shared.bin"),
        unique("same", 3_000_000),
    )
    .unwrap();
    let spec = same.spec();
    std::thread::scope(|s| {
        let runs: Vec<_> = (0..6)
            .map(|_| s.spawn(|| roles.client("client-bob", &["fork", "create", path_str(&spec)])))
            .collect();
        for r in runs {
            let ran = r.join().unwrap();
            assert_eq!(ran.code, Some(0), "{}\n{}", ran.stderr, roles.logs());
        }
    });
}

/// The default limits (`stream_mb`, `blob_store_mb`) ask for more storage than a small
/// server has (JetStream reserves each `max_bytes`; the base Kubernetes NATS has 8 GB of
/// `max_file_store`): each is halved until it fits, and the bus comes up and works.
#[test]
fn the_default_limits_fit_a_small_server() {
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("small.conf");
    std::fs::write(&conf, "jetstream { max_file_store: 8GB }\n").unwrap();
    let server = forkfleet_bus::testkit::NatsServer::start_with_config(&conf);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let bus = NatsBus::connect(NatsConfig::new(server.url()))
            .await
            .unwrap();
        let bytes = unique("fits", 300_000);
        let hash = BlobHash::of(&bytes);
        bus.blobs().put(hash, bytes.clone().into()).await.unwrap();
        let got = bus.blobs().get(&hash).await.unwrap();
        assert_eq!(got.as_deref(), Some(bytes.as_slice()));
    });
}
