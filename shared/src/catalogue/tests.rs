use super::*;
use crate::spec::{validate, ModelPlan, SpecFile};

/// A one-branch plan of `model`, as the spec loader makes it (a scripted model gets its
/// script file).
fn plan_with_model(model: &str) -> ForkPlan {
    let script = if model.starts_with("scripted:") {
        "script = \"s.toml\""
    } else {
        ""
    };
    let text = format!(
        "goal = \"g\"\nworkspace = \"w\"\nmodel = \"{model}\"\n[models.\"{model}\"]\n{script}\n[[branches]]\n"
    );
    let file: SpecFile = toml::from_str(&text).unwrap();
    validate(&file, 0).unwrap()
}

fn catalogue() -> ModelCatalogue {
    let mut models = BTreeMap::new();
    models.insert(
        "openai:gpt-4o".to_string(),
        CatalogueModel {
            base_url: Some("https://api.openai.com/v1".into()),
            api_key_env: Some("OPENAI_API_KEY".into()),
            model: Some("gpt-4o-2024-08-06".into()),
            timeout_s: Some(60.0),
            ..CatalogueModel::default()
        },
    );
    ModelCatalogue {
        models,
        allowed_hosts: vec!["127.0.0.1".into(), "llm.internal:8080".into()],
    }
}

fn at(url: &str) -> Endpoint {
    Endpoint {
        base_url: Some(url.into()),
        ..Endpoint::default()
    }
}

#[test]
fn a_catalogue_model_routes_with_its_key_and_a_spec_url_without_one() {
    let c = catalogue();
    let r = c.route("openai:gpt-4o", None).unwrap();
    assert_eq!(r.base_url.as_deref(), Some("https://api.openai.com/v1"));
    assert_eq!(r.key, Some(KeySource::Env("OPENAI_API_KEY".into())));
    assert_eq!(r.model.as_deref(), Some("gpt-4o-2024-08-06"));
    assert_eq!(r.timeout_s, Some(60.0));
    // The spec's timeout wins; its settings never bring a key.
    let spec = Endpoint {
        timeout_s: Some(5.0),
        ..Endpoint::default()
    };
    assert_eq!(
        c.route("openai:gpt-4o", Some(&spec)).unwrap().timeout_s,
        Some(5.0)
    );
    // A spec base_url on an allowed host: no key, even for a catalogue model.
    for url in [
        "http://127.0.0.1:9999/v1",
        "http://127.0.0.1/v1",
        "http://llm.internal:8080/v1",
        "http://LLM.internal:8080",
    ] {
        let r = c.route("openai:gpt-4o", Some(&at(url))).unwrap();
        assert_eq!(r.base_url.as_deref(), Some(url));
        assert_eq!(r.key, None, "{url}");
        assert_eq!(r.model, None);
    }
}

#[test]
fn the_worker_refuses_what_its_catalogue_does_not_allow() {
    let c = catalogue();
    for (url, host) in [
        ("http://capture.example:7777/v1", "capture.example:7777"),
        ("http://llm.internal:9090/v1", "llm.internal:9090"),
        ("https://llm.internal/v1", "llm.internal"),
        ("http://127.0.0.2:80/v1", "127.0.0.2:80"),
    ] {
        let err = c.route("openai:gpt-4o", Some(&at(url))).unwrap_err();
        for says in [
            "model `openai:gpt-4o`",
            &format!("host `{host}`"),
            "allowed: 127.0.0.1, llm.internal:8080",
            "[model_hosts] allow",
        ] {
            assert!(err.contains(says), "{says:?} not in {err}");
        }
    }
    let err = c.route("openai:other", None).unwrap_err();
    assert!(
        err.contains("model `openai:other` is not in the model catalogue of this worker")
            && err.contains("offered: openai:gpt-4o")
            && err.contains("[models.\"openai:other\"]"),
        "{err}"
    );
    // A key source in a task (a plan that got past every other check) is refused too.
    let forged = Endpoint {
        api_key_file: Some("/run/secrets/nats-password".into()),
        ..at("http://127.0.0.1:1/v1")
    };
    let err = c.route("openai:gpt-4o", Some(&forged)).unwrap_err();
    assert!(
        err.contains("api_key_file is not allowed in a spec"),
        "{err}"
    );
    // With no allow-list, no spec URL at all.
    let err = ModelCatalogue::default()
        .route("openai:x", Some(&at("http://127.0.0.1:1/v1")))
        .unwrap_err();
    assert!(err.contains("allowed: none"), "{err}");
}

#[test]
fn hosts_are_parsed_strictly() {
    let h = url_host("http://[::1]:8080/v1").unwrap();
    assert_eq!((h.host.as_str(), h.port), ("::1", 8080));
    assert_eq!(h.to_string(), "[::1]:8080");
    assert_eq!(url_host("https://api.openai.com/v1").unwrap().port, 443);
    for bad in [
        "ftp://x",
        "http://",
        "http:///v1",
        "http://u:p@host/v1",
        "http://host:notaport/",
        "127.0.0.1",
    ] {
        assert!(url_host(bad).is_none(), "{bad}");
    }
    // `evil.com#@127.0.0.1` and friends: the authority ends at the first `/`, `?` or `#`.
    assert!(!host_allowed(
        &["127.0.0.1".into()],
        "http://evil.example#@127.0.0.1/"
    ));
    assert!(!host_allowed(
        &["127.0.0.1".into()],
        "http://127.0.0.1.evil.example/"
    ));
    for ok in ["127.0.0.1", "llm.internal:8080", "[::1]:80", "host"] {
        check_allowed_host(ok).unwrap();
    }
    for bad in ["http://x", "x/v1", "u@x", "x:port", ""] {
        let err = check_allowed_host(bad).unwrap_err();
        assert!(err.contains("host:port"), "{err}");
    }
}

#[test]
fn entries_are_checked() {
    catalogue()
        .models
        .values()
        .for_each(|m| m.validate("openai:gpt-4o").unwrap());
    for (name, entry, says) in [
        ("scripted:x", CatalogueModel::default(), "openai:NAME"),
        ("gpt-4o", CatalogueModel::default(), "openai:NAME"),
        (
            "openai:x",
            CatalogueModel {
                base_url: Some("api.openai.com".into()),
                ..CatalogueModel::default()
            },
            "base_url",
        ),
        (
            "openai:x",
            CatalogueModel {
                api_key_env: Some("A".into()),
                api_key_file: Some("/k".into()),
                ..CatalogueModel::default()
            },
            "not both",
        ),
        (
            "openai:x",
            CatalogueModel {
                api_key_env: Some("1-BAD".into()),
                ..CatalogueModel::default()
            },
            "api_key_env",
        ),
        (
            "anthropic:x",
            CatalogueModel {
                max_retries: Some(99),
                ..CatalogueModel::default()
            },
            "max_retries",
        ),
        (
            "anthropic:x",
            CatalogueModel {
                model: Some(" ".into()),
                ..CatalogueModel::default()
            },
            "model is empty",
        ),
    ] {
        let err = entry.validate(name).unwrap_err();
        assert!(err.contains(says), "{name}: {err}");
    }
}

#[test]
fn a_plan_is_checked_against_the_offers() {
    let mut plan = plan_with_model("openai:gpt-4o");
    let offers = vec![catalogue().offer()];
    assert_eq!(offers[0].models[0].dialect, "openai");
    check_plan(&plan, "default", &offers).unwrap();
    // Nobody offers it.
    plan = plan_with_model("anthropic:claude");
    let err = check_plan(&plan, "gpu", &offers).unwrap_err();
    assert!(
        err.contains("model `anthropic:claude` is not in the model catalogue of any live worker of pool `gpu` (offered: openai:gpt-4o)"),
        "{err}"
    );
    // A spec URL whose host no worker allows.
    plan.models.insert(
        "anthropic:claude".into(),
        ModelPlan {
            price: None,
            script: None,
            endpoint: Some(at("http://10.0.0.9:1234/v1")),
        },
    );
    let err = check_plan(&plan, "default", &offers).unwrap_err();
    assert!(
        err.contains("host `10.0.0.9:1234`")
            && err.contains("allowed: 127.0.0.1, llm.internal:8080"),
        "{err}"
    );
    plan.models.get_mut("anthropic:claude").unwrap().endpoint =
        Some(at("http://llm.internal:8080/v1"));
    check_plan(&plan, "default", &offers).unwrap();
    // Scripted models need no offer.
    let scripted = plan_with_model("scripted:demo");
    check_plan(&scripted, "default", &[]).unwrap();
}
