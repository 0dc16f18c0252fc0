//! The web console (docs/CONSOLE.md) in a real headless Chromium (Debian's `chromium`,
//! driven through `chromedriver`'s WebDriver protocol): a fork of the quickstart watched
//! live from running to done, the side-by-side diff of `greet.py` across two branches, a
//! branch's conversation, a merge through its preview that changes the workspace, the
//! lineage and the workers; and a fork of 1,000 branches that renders and filters with a
//! few rows in the page. With `FORKFLEET_CAPTURES=update`, screenshots go to
//! `docs/console/` (what docs/CONSOLE.md shows) and the 1,000-branch timings to
//! `target/console-timings.json` (docs/BENCHMARKS.md).

use super::fleet::{COMMAND_LIMIT, POLL};
use super::harness::Example;
use super::http::{create_from_spec, Ui};
use base64::Engine;
use reqwest::blocking::Client;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// chromedriver and one session of a headless Chromium.
struct Browser {
    driver: Child,
    url: String,
    session: String,
    http: Client,
    shots: Option<PathBuf>,
}

impl Browser {
    fn start() -> Browser {
        let port = forkfleet_bus::testkit::free_port();
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver (scripts/setup installs chromium-driver)");
        let url = format!("http://127.0.0.1:{port}");
        let http = Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap();
        let deadline = Instant::now() + COMMAND_LIMIT;
        loop {
            let ready = http
                .get(format!("{url}/status"))
                .send()
                .ok()
                .and_then(|r| r.text().ok())
                .is_some_and(|t| t.contains("\"ready\":true"));
            if ready {
                break;
            }
            assert!(Instant::now() < deadline, "chromedriver never became ready");
            std::thread::sleep(POLL);
        }
        let caps = json!({ "capabilities": { "alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium(),
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,1000"]
            }
        } } });
        let created: Value = serde_json::from_str(
            &http
                .post(format!("{url}/session"))
                .body(caps.to_string())
                .send()
                .unwrap()
                .text()
                .unwrap(),
        )
        .unwrap();
        let session = created["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no browser session: {created}"))
            .to_string();
        let shots = (std::env::var("FORKFLEET_CAPTURES").as_deref() == Ok("update"))
            .then(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/console"));
        Browser {
            driver,
            url,
            session,
            http,
            shots,
        }
    }

    fn post(&self, path: &str, body: Value) -> Value {
        let text = self
            .http
            .post(format!("{}/session/{}{path}", self.url, self.session))
            .body(body.to_string())
            .send()
            .unwrap()
            .text()
            .unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        assert!(v["value"]["error"].is_null(), "{path}: {v}");
        v["value"].clone()
    }

    fn goto(&self, url: &str) {
        self.post("/url", json!({ "url": url }));
    }

    /// Run `script` (a function body; `arguments` are `args`) in the page; its result.
    fn js(&self, script: &str, args: Value) -> Value {
        self.post("/execute/sync", json!({ "script": script, "args": args }))
    }

    /// Until `script` returns something truthy (bounded); that.
    fn wait(&self, what: &str, script: &str) -> Value {
        let deadline = Instant::now() + COMMAND_LIMIT;
        loop {
            let v = self.js(script, json!([]));
            if !(v.is_null() || v == json!(false) || v == json!(0) || v == json!("")) {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "{what} never showed; the page says: {}",
                self.js("return document.body.innerText.slice(0, 2000)", json!([]))
            );
            std::thread::sleep(POLL);
        }
    }

    /// Keep a screenshot as `name` (when captures are asked for).
    fn shot(&self, name: &str) {
        let Some(dir) = &self.shots else { return };
        let text = self
            .http
            .get(format!("{}/session/{}/screenshot", self.url, self.session))
            .send()
            .unwrap()
            .text()
            .unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        let png = base64::engine::general_purpose::STANDARD
            .decode(v["value"].as_str().unwrap())
            .unwrap();
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(format!("{name}.png")), png).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self
            .http
            .delete(format!("{}/session/{}", self.url, self.session))
            .send();
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

fn chromium() -> String {
    [
        "/usr/bin/chromium",
        "/usr/bin/chromium-browser",
        "/usr/bin/google-chrome",
    ]
    .into_iter()
    .find(|p| Path::new(p).exists())
    .unwrap_or("/usr/bin/chromium")
    .to_string()
}

/// The badges of the branch rows, in order.
const BADGES: &str =
    "(() => [...document.querySelectorAll('#b-spacer .vrow .badge')].map(b => b.textContent))";

#[test]
fn the_console_follows_a_fork_live_compares_merges_and_shows_lineage() {
    let ex = Example::quickstart();
    // Slow enough to be seen running.
    let script = ex.dir.path().join("script.toml");
    let text = std::fs::read_to_string(&script).unwrap();
    std::fs::write(
        &script,
        text.replacen("[defaults]\n", "[defaults]\nlatency_ms = 2500\n", 1),
    )
    .unwrap();
    let ui = Ui::start(&ex.data());
    // The browser first, so the page opens while the branches still run.
    let b = Browser::start();
    let (view, _) = create_from_spec(&Client::new(), &ui.base, &ui.token, &ex.spec(), None);
    let fork = view["fork_id"].as_str().unwrap().to_string();
    b.goto(&format!("{}&page=/forks/{fork}", ui.console));
    let badges = b.wait(
        "three running branches",
        &format!("const b = {BADGES}(); return b.length === 3 && b.includes('running') && b"),
    );
    assert_eq!(badges.as_array().unwrap().len(), 3);
    b.shot("01-fork-running");
    b.wait(
        "three done branches",
        &format!("const b = {BADGES}(); return b.length === 3 && b.every(x => x === 'done')"),
    );
    b.wait(
        "the diff matrix",
        "return document.querySelectorAll('#fk-diff td.cell').length",
    );
    b.shot("02-fork-done");

    // greet.py across two branches and the parent.
    b.js("document.querySelector('td.cell[data-path=\"greet.py\"][data-branch=\"concise\"]').click()", json!([]));
    b.wait(
        "the side-by-side diff",
        "return document.querySelectorAll('#sbs pre').length === 3",
    );
    b.js("const s = document.querySelector('[data-side=\"b\"]'); s.value = 'thorough'; s.dispatchEvent(new Event('change'))", json!([]));
    let sides = b.wait(
        "greet.py of concise and thorough",
        "const p = [...document.querySelectorAll('#sbs pre')].map(x => x.textContent); return p.length === 3 && p[2].includes(\"name or 'world'\") && p",
    );
    assert!(
        sides[1].as_str().unwrap().contains("Hello, {name}!"),
        "{sides}"
    );
    assert!(sides[0].as_str().unwrap().contains("def greet"), "{sides}");
    b.shot("03-diff-greet");
    b.js("document.querySelector('#modal').click()", json!([]));

    // A branch: its conversation; merged through its preview.
    b.js(
        "document.querySelector('.vrow[data-label=\"concise\"]').click()",
        json!([]),
    );
    b.wait(
        "concise's conversation",
        "return document.querySelectorAll('#bp-conv .msg').length > 2",
    );
    b.shot("04-branch");
    b.js("document.querySelector('#bp-merge').click()", json!([]));
    let preview = b.wait("the merge preview", "const ok = document.querySelector('#mp-ok'); return ok && document.querySelector('#mp').innerText");
    assert!(preview.as_str().unwrap().contains("greet.py"), "{preview}");
    b.shot("05-merge-preview");
    b.js("document.querySelector('#mp-ok').click()", json!([]));
    b.wait(
        "the merge",
        "return document.querySelector('#toast').textContent.includes('merged concise')",
    );
    let deadline = Instant::now() + COMMAND_LIMIT;
    let greet = ex.workspace().join("greet.py");
    while !std::fs::read_to_string(&greet)
        .unwrap()
        .contains("Hello, {name}!")
    {
        assert!(Instant::now() < deadline, "the workspace never changed");
        std::thread::sleep(POLL);
    }
    b.wait(
        "the fork merged",
        "return document.querySelector('#fk-head .badge').textContent.includes('merged')",
    );
    b.shot("06-merged");

    // Lineage and workers.
    b.goto(&format!("{}&page=/runs", ui.console));
    let tree = b.wait("the lineage", "return document.querySelectorAll('#tree li').length >= 4 && document.querySelector('#tree').innerText");
    assert!(tree.as_str().unwrap().contains("★"), "{tree}");
    b.shot("07-lineage");
    b.goto(&format!("{}&page=/workers", ui.console));
    b.wait(
        "the workers",
        "return document.querySelectorAll('#w tr').length >= 2",
    );
    b.shot("08-workers");
    drop(b);
    ui.stop();
}

#[test]
fn a_fork_of_a_thousand_branches_renders_and_filters_with_few_rows_in_the_page() {
    let dir = tempfile::tempdir().unwrap();
    let (ui, _http, fork) =
        super::http::thousand_branch_fork(dir.path(), "[[turns.\"*\"]]\ntext = \"done {label}\"\n");
    let b = Browser::start();
    b.goto(&format!("{}&page=/forks", ui.console));
    b.wait(
        "the forks list",
        "return document.querySelectorAll('#f-list tr').length >= 2",
    );
    // In the page: from opening the fork to its first rows, and a filter's redraw.
    let opened = b.js(
        "window.__t0 = performance.now(); location.hash = '#/forks/' + arguments[0]; return true",
        json!([fork]),
    );
    assert_eq!(opened, json!(true));
    let first = b.wait(
        "the first rows",
        "return document.querySelectorAll('#b-spacer .vrow').length > 0 && document.querySelector('#b-count').textContent.endsWith('of 1000') && (window.__t1 = window.__t1 || performance.now() - window.__t0)",
    );
    let rows_in_page = b.js(
        "return document.querySelectorAll('#b-spacer .vrow').length",
        json!([]),
    );
    assert!(
        rows_in_page.as_u64().unwrap() < 80,
        "the list is not virtualised: {rows_in_page} rows"
    );
    let filter = b.js(
        "const t = performance.now(); const i = document.querySelector('#b-label'); i.value = 'b09'; i.dispatchEvent(new Event('input')); return [performance.now() - t, document.querySelector('#b-count').textContent]",
        json!([]),
    );
    assert_eq!(filter[1], "100 of 1000", "{filter}");
    b.js(
        "const l = document.querySelector('#b-list'); l.scrollTop = l.scrollHeight",
        json!([]),
    );
    b.wait(
        "the last of the filtered rows",
        "return [...document.querySelectorAll('#b-spacer .vrow')].some(r => r.dataset.label === 'b0999')",
    );
    b.shot("09-thousand-branches");
    let timings = json!({ "branches": 1000, "first_rows_ms": first, "filter_ms": filter[0] });
    eprintln!("console timings: {timings}");
    if b.shots.is_some() {
        let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/console-timings.json");
        std::fs::write(out, timings.to_string()).unwrap();
    }
    drop(b);
    ui.stop();
}
