//! Properties of the kubelet credential provider protocol: whatever the kubelet (or anyone)
//! writes on stdin, the parser answers without panicking and never repeats the service
//! account token in an error; a valid request of any version reads back as written; the
//! answer keeps the request's version, and its cache duration is a Go duration the kubelet
//! reads back as the provider's.

use std::collections::BTreeMap;
use std::time::Duration;

use ccm_node_metadata::credential_provider::{GROUP, Request, VERSIONS, go_duration, parse_request, to_grpc, to_response};
use ccm_proto::v1 as pb;
use proptest::prelude::*;

fn image() -> impl Strategy<Value = String> {
    (
        prop_oneof![Just(String::new()), "[a-z]{1,8}(\\.[a-z]{2,5}){1,2}(:[1-9][0-9]{0,4})?/"],
        "[a-z0-9]{1,10}(/[a-z0-9]{1,10}){0,2}",
        prop_oneof![Just(String::new()), ":[a-zA-Z0-9_][a-zA-Z0-9_.-]{0,20}"],
    )
        .prop_map(|(host, path, tag)| format!("{host}{path}{tag}"))
}

fn request() -> impl Strategy<Value = Request> {
    (
        prop::sample::select(VERSIONS),
        image(),
        prop_oneof![Just(String::new()), "tok-[A-Za-z0-9]{12}"],
        prop::collection::btree_map("[a-z./-]{1,20}", "[ -~]{0,20}", 0..3),
    )
        .prop_map(|(version, image, token, annotations)| Request {
            api_version: format!("{GROUP}/{version}"),
            kind: "CredentialProviderRequest".into(),
            image,
            service_account_token: token,
            service_account_annotations: annotations,
        })
}

/// Seconds of a Go duration as [`go_duration`] writes it (`1h2m3s`, `4m5s`, `6s`).
fn seconds_of(text: &str) -> Option<u64> {
    let mut total = 0;
    let mut number = String::new();
    for c in text.chars() {
        if c.is_ascii_digit() {
            number.push(c);
            continue;
        }
        let n: u64 = number.parse().ok()?;
        number.clear();
        total += n * match c {
            'h' => 3600,
            'm' => 60,
            's' => 1,
            _ => return None,
        };
    }
    number.is_empty().then_some(total)
}

proptest! {
    #[test]
    fn any_bytes_are_answered(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        let _ = parse_request(&bytes);
    }

    #[test]
    fn any_json_object_is_answered_and_errors_never_show_the_token(
        version in "[ -~]{0,40}",
        kind in prop_oneof![Just("CredentialProviderRequest".to_string()), "[ -~]{0,20}"],
        image in "[ -~]{0,60}",
        token in "tok-[A-Za-z0-9]{12}",
    ) {
        let json = serde_json::json!({ "apiVersion": version, "kind": kind, "image": image, "serviceAccountToken": token });
        if let Err(error) = parse_request(json.to_string().as_bytes()) {
            let text = format!("{error:#}");
            prop_assert!(!text.contains(&token), "the error shows the token: {}", text);
        }
    }

    #[test]
    fn valid_requests_read_back_as_written(r in request()) {
        let text = serde_json::to_vec(&r).expect("json");
        let read = parse_request(&text).expect("a valid request is accepted");
        let debug = format!("{read:?}");
        prop_assert!(r.service_account_token.is_empty() || !debug.contains(&r.service_account_token));
        let grpc = to_grpc(&read);
        prop_assert_eq!(&grpc.image, &r.image);
        prop_assert_eq!(&grpc.service_account_token, &r.service_account_token);
        prop_assert_eq!(grpc.service_account_annotations.into_iter().collect::<BTreeMap<_, _>>(), r.service_account_annotations.clone());
        prop_assert_eq!(read, r);
    }

    #[test]
    fn answers_keep_the_version_and_a_readable_cache_duration(
        r in request(),
        seconds in prop::option::of(0i64..10_000_000),
        key in 0i32..5,
        registries in prop::collection::btree_map("[a-z.]{1,12}", ("[a-z]{1,8}", "pw-[A-Za-z0-9]{1,16}"), 0..3),
    ) {
        let answer = pb::GetImageCredentialsResponse {
            cache_key_type: key,
            cache_duration: seconds.map(|s| prost_types::Duration { seconds: s, nanos: 0 }),
            auth: registries.iter().map(|(k, (u, p))| (k.clone(), pb::RegistryCredential { username: u.clone(), password: p.clone() })).collect(),
        };
        let response = to_response(&r, answer);
        prop_assert_eq!(&response.api_version, &r.api_version);
        prop_assert_eq!(response.kind.as_str(), "CredentialProviderResponse");
        prop_assert!(["Image", "Registry", "Global"].contains(&response.cache_key_type.as_str()));
        prop_assert_eq!(response.auth.len(), registries.len());
        match (seconds, &response.cache_duration) {
            (Some(s), Some(d)) => prop_assert_eq!(seconds_of(d), Some(s as u64)),
            (None, None) => prop_assert!(!registries.is_empty(), "no hint, no credentials: a short negative cache"),
            (None, Some(d)) => prop_assert!(registries.is_empty() && seconds_of(d) == Some(60)),
            (Some(_), None) => prop_assert!(false, "the provider's cache hint was lost"),
        }
        // Secrets stay out of debug output.
        let debug = format!("{response:?}");
        for (_, password) in registries.values() {
            prop_assert!(!debug.contains(password.as_str()));
        }
    }

    #[test]
    fn go_durations_read_back(seconds in 0u64..100_000_000) {
        prop_assert_eq!(seconds_of(&go_duration(Duration::from_secs(seconds))), Some(seconds));
    }
}
