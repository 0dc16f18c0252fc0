//! `http_get` against a real local HTTP server (axum on 127.0.0.1:0): allowed hosts only,
//! redirects checked at every hop, the body cut at `max_bytes`, binary bodies not shown,
//! a failing status a failed result, and off unless the settings enable it.

use super::common::Fixture;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Redirect};
use axum::routing::get;
use axum::Router;
use forkfleet_shared::event::ToolCall;
use forkfleet_shared::overlay::Overlay;
use forkfleet_shared::tools::{HttpGetSection, ToolSettings};
use forkfleet_worker::cache::BlobCache;
use forkfleet_worker::tools::{ToolBox, ToolOutcome};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

/// A server on 127.0.0.1 with a few pages; its port. `other` is a port nothing allows.
async fn serve(other: u16) -> u16 {
    let app =
        Router::new()
            .route("/page", get(|| async { "hello from the page" }))
            .route(
                "/big",
                get(|| async { ([(header::CONTENT_TYPE, "text/plain")], "x".repeat(5000)) }),
            )
            .route(
                "/binary",
                get(|| async {
                    (
                        [(header::CONTENT_TYPE, "application/octet-stream")],
                        vec![0u8, 1, 2, 3, 0, 255],
                    )
                }),
            )
            .route(
                "/missing",
                get(|| async { (StatusCode::NOT_FOUND, "no such page").into_response() }),
            )
            .route("/hop", get(|| async { Redirect::temporary("/page") }))
            .route(
                "/away",
                get(move || async move {
                    Redirect::temporary(&format!("http://127.0.0.1:{other}/page"))
                }),
            )
            .route("/loop", get(|| async { Redirect::temporary("/loop") }))
            .route(
                "/huge",
                get(|| async { ([(header::CONTENT_TYPE, "text/plain")], "é".repeat(40_000)) }),
            )
            .route(
                "/escapes",
                get(|| async { "before\x1b[2J\x1b]0;title\x07after\ttab\nline" }),
            );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    port
}

struct Get {
    tools: ToolBox,
    ov: Overlay,
    cache: BlobCache,
    _fx: Fixture,
}

impl Get {
    fn new(settings: ToolSettings) -> Self {
        let fx = Fixture::store_only();
        let (base, _) = fx.snapshot(&[]);
        Self {
            tools: ToolBox::with_settings(settings),
            ov: Overlay::new(base),
            cache: BlobCache::new(Arc::new(fx.store.clone()), 1 << 20),
            _fx: fx,
        }
    }

    fn allowing(allow: &[String], max_bytes: Option<u32>) -> Self {
        let section = HttpGetSection {
            allow: allow.to_vec(),
            timeout_s: Some(10.0),
            max_bytes,
        };
        Self::new(ToolSettings {
            http_get: Some(section.build().unwrap()),
            ..ToolSettings::default()
        })
    }

    async fn get(&mut self, url: &str) -> ToolOutcome {
        let call = ToolCall {
            id: "g1".into(),
            name: "http_get".into(),
            args: json!({ "url": url }),
        };
        tokio::time::timeout(
            Duration::from_secs(30),
            self.tools.run(&call, &mut self.ov, &self.cache),
        )
        .await
        .expect("http_get answers within 30 s")
        .unwrap()
    }
}

/// A port with nothing listening (bound, then closed).
fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test]
async fn an_allowed_host_is_fetched_and_its_body_read_as_text() {
    let port = serve(closed_port()).await;
    let mut g = Get::allowing(&[format!("127.0.0.1:{port}")], Some(1000));
    let page = g.get(&format!("http://127.0.0.1:{port}/page")).await;
    assert!(page.ok, "{}", page.output);
    assert!(page.output.contains("200 OK"), "{}", page.output);
    assert!(
        page.output.ends_with("hello from the page"),
        "{}",
        page.output
    );
    // A redirect on the same allowed host is followed.
    let hop = g.get(&format!("http://127.0.0.1:{port}/hop")).await;
    assert!(
        hop.ok && hop.output.contains("hello from the page"),
        "{}",
        hop.output
    );
    // Cut at max_bytes, and said so.
    let big = g.get(&format!("http://127.0.0.1:{port}/big")).await;
    assert!(big.ok, "{}", big.output);
    assert!(big.output.contains(&"x".repeat(1000)), "{}", big.output);
    assert!(!big.output.contains(&"x".repeat(1001)), "{}", big.output);
    assert!(big.output.contains("cut at 1000 bytes"), "{}", big.output);
    // A binary body is not shown.
    let bin = g.get(&format!("http://127.0.0.1:{port}/binary")).await;
    assert!(
        bin.output.contains("binary body (6 bytes"),
        "{}",
        bin.output
    );
    // Control characters a server sends never reach the model (or a terminal) as such.
    let esc = g.get(&format!("http://127.0.0.1:{port}/escapes")).await;
    assert!(
        !esc.output.contains('\x1b') && !esc.output.contains('\x07'),
        "{:?}",
        esc.output
    );
    assert!(esc.output.contains("after\ttab\nline"), "{:?}", esc.output);
    // Arguments it does not take are refused, naming them.
    let call = ToolCall {
        id: "g2".into(),
        name: "http_get".into(),
        args: json!({ "url": format!("http://127.0.0.1:{port}/page"), "method": "POST" }),
    };
    let extra = g.tools.run(&call, &mut g.ov, &g.cache).await.unwrap();
    assert!(
        !extra.ok && extra.output.contains("method"),
        "{}",
        extra.output
    );
    // A failing status is a failed result that shows the body.
    let missing = g.get(&format!("http://127.0.0.1:{port}/missing")).await;
    assert!(!missing.ok, "{}", missing.output);
    assert!(missing.output.contains("404") && missing.output.contains("no such page"));
}

#[tokio::test]
async fn the_largest_max_bytes_fits_a_tools_answer_and_the_cut_is_said_first() {
    let port = serve(closed_port()).await;
    let most = forkfleet_shared::tools::HTTP_GET_MAX_MAX_BYTES;
    let mut g = Get::allowing(&[format!("127.0.0.1:{port}")], Some(most));
    let huge = g.get(&format!("http://127.0.0.1:{port}/huge")).await;
    assert!(huge.ok, "{}", &huge.output[..200]);
    assert!(
        huge.output.contains(&format!("cut at {most} bytes")),
        "{}",
        &huge.output[..300]
    );
    assert!(
        !huge.output.contains("[output truncated"),
        "the tool's own cut never comes"
    );
    // Cut between characters (`é` is two bytes), never inside one.
    assert!(!huge.output.contains('\u{fffd}'));
    assert_eq!(huge.output.matches('é').count() as u32, most / 2);
    // An address without a port in the list allows every port of it.
    let mut any = Get::allowing(&["127.0.0.1".to_string()], None);
    assert!(any.get(&format!("http://127.0.0.1:{port}/page")).await.ok);
}

#[tokio::test]
async fn hosts_ports_schemes_and_redirects_outside_the_allow_list_are_refused() {
    let other = closed_port();
    let port = serve(other).await;
    let mut g = Get::allowing(&[format!("127.0.0.1:{port}")], None);
    for (url, says) in [
        (format!("http://127.0.0.1:{other}/page"), "is not allowed"),
        (format!("http://localhost:{port}/page"), "is not allowed"),
        (
            "file:///etc/passwd".to_string(),
            "`file` URLs cannot be fetched",
        ),
        (
            format!("http://user:secret@127.0.0.1:{port}/page"),
            "user or password",
        ),
        ("not a url".to_string(), "is not a URL"),
        // A redirect to a host the list does not name stops there.
        (format!("http://127.0.0.1:{port}/away"), "redirected to"),
        (format!("http://127.0.0.1:{port}/loop"), "redirects"),
    ] {
        let out = g.get(&url).await;
        assert!(!out.ok, "{url}: {}", out.output);
        assert!(out.output.contains(says), "{url}: {}", out.output);
        assert!(!out.output.contains("secret"), "{url}: {}", out.output);
    }
    // The refusal names what is allowed.
    let out = g.get(&format!("http://127.0.0.1:{other}/")).await;
    assert!(
        out.output.contains(&format!("allowed: 127.0.0.1:{port}")),
        "{}",
        out.output
    );
}

#[tokio::test]
async fn http_get_is_neither_offered_nor_run_unless_enabled() {
    let port = serve(closed_port()).await;
    let mut g = Get::new(ToolSettings::default());
    assert!(!g.tools.names().contains(&"http_get"));
    let out = g.get(&format!("http://127.0.0.1:{port}/page")).await;
    assert!(!out.ok);
    assert!(out.output.contains("not enabled"), "{}", out.output);
    let on = Get::allowing(&["docs.rs".into()], None);
    assert_eq!(on.tools.names().last(), Some(&"http_get"));
    let spec = on
        .tools
        .specs()
        .iter()
        .find(|s| s.name == "http_get")
        .unwrap();
    assert_eq!(spec.parameters["required"], json!(["url"]));
}
