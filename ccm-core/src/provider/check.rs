//! What the core makes of an invalid provider answer (the checks themselves are
//! `ccm_protocol::answer`): an error naming the method and what is wrong, so nothing of it
//! reaches the API server; and the bounds of one listing.

use std::collections::HashSet;
use std::fmt::Display;

use ccm_protocol::{Error, reason};

/// The most pages one listing may take (10,000 pages of the default size is millions of items).
pub const MAX_PAGES: usize = 10_000;

/// The reason of an invalid provider answer, in its error and in the Warning Event about it.
pub const REASON: &str = crate::events::reason::INVALID_PROVIDER_ANSWER;

/// The error of an invalid answer to `method`.
pub fn invalid(method: &str, why: impl Display) -> Error {
    Error::internal_because(reason::INVALID_ANSWER, format!("{REASON}: the provider's answer to {method} is invalid: {why}"))
}

/// Whether `error` is about an invalid provider answer (see [`invalid`]): by its reason, not
/// its text.
pub fn is_invalid(error: &Error) -> bool {
    error.reason() == reason::INVALID_ANSWER
}

/// The page tokens of one listing: a bounded number of pages, and no token twice (a provider
/// answering the same token again would loop for ever).
#[derive(Debug, Default)]
pub struct Pages {
    seen: HashSet<String>,
}

impl Pages {
    /// Takes the next page's token; `Ok(None)` at the end of the listing.
    pub fn next(&mut self, method: &str, token: String) -> Result<Option<String>, Error> {
        if token.is_empty() {
            return Ok(None);
        }
        if self.seen.len() + 1 >= MAX_PAGES {
            return Err(invalid(method, format!("the listing goes on past {MAX_PAGES} pages")));
        }
        if !self.seen.insert(token.clone()) {
            return Err(invalid(method, format!("page token {token:?} came back a second time")));
        }
        Ok(Some(token))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_page_token_ends_the_listing_with_an_error() {
        let mut pages = Pages::default();
        assert_eq!(pages.next("M", "a".into()).expect("ok"), Some("a".into()));
        assert_eq!(pages.next("M", "b".into()).expect("ok"), Some("b".into()));
        let again = pages.next("M", "a".into()).expect_err("an error");
        assert!(is_invalid(&again), "{again}");
        assert_eq!(Pages::default().next("M", String::new()).expect("ok"), None);
    }

    #[test]
    fn an_invalid_answer_is_known_by_its_reason_not_its_text() {
        assert!(is_invalid(&invalid("M", "why")));
        assert!(!is_invalid(&Error::internal(format!("{REASON}: only the text says so"))));
        let back = Error::from_status(&invalid("M", "why").into_status());
        assert!(is_invalid(&back), "the reason survives the wire: {back:?}");
    }
}
