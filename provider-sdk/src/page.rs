//! Pagination for List calls: stable order, opaque tokens, no repeats and no drops.
//!
//! Items are ordered by a string key; a page token names the last key served, so an item
//! added or removed between pages never shifts the others (offset tokens would).

use crate::error::{Error, Result, reason};

/// Page size used when the caller asks for 0.
pub const DEFAULT_PAGE_SIZE: u32 = 100;
/// The largest page served; larger requests are clamped.
pub const MAX_PAGE_SIZE: u32 = 1000;
const TOKEN_PREFIX: &str = "k1.";

/// What the caller asked for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PageRequest {
    /// Requested size; 0 means [`DEFAULT_PAGE_SIZE`].
    pub page_size: u32,
    /// The previous page's `next_page_token`, or empty.
    pub page_token: String,
}

/// One page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page<T> {
    /// The items of this page.
    pub items: Vec<T>,
    /// The token of the next page; empty on the last.
    pub next_page_token: String,
}

impl PageRequest {
    /// A request for `page_size` items after `page_token`.
    pub fn new(page_size: u32, page_token: impl Into<String>) -> Self {
        Self { page_size, page_token: page_token.into() }
    }

    /// The effective page size.
    pub fn size(&self) -> usize {
        match self.page_size {
            0 => DEFAULT_PAGE_SIZE as usize,
            n => n.min(MAX_PAGE_SIZE) as usize,
        }
    }

    /// The key after which this page starts; `None` for the first page.
    /// A token this module did not issue is INVALID_ARGUMENT.
    pub fn after(&self) -> Result<Option<String>> {
        if self.page_token.is_empty() {
            return Ok(None);
        }
        let bad =
            || Error::invalid_argument_because(reason::INVALID_PAGE_TOKEN, format!("malformed page token {:?}", self.page_token));
        let hex = self.page_token.strip_prefix(TOKEN_PREFIX).ok_or_else(bad)?;
        if hex.len() % 2 != 0 {
            return Err(bad());
        }
        let bytes = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(hex.get(i..i + 2).unwrap_or("zz"), 16))
            .collect::<std::result::Result<Vec<u8>, _>>()
            .map_err(|_| bad())?;
        String::from_utf8(bytes).map(Some).map_err(|_| bad())
    }
}

/// The token of the page that starts after `key`, as [`paginate`] issues it.
pub fn token_for(key: &str) -> String {
    let mut token = String::with_capacity(TOKEN_PREFIX.len() + key.len() * 2);
    token.push_str(TOKEN_PREFIX);
    for b in key.bytes() {
        token.push_str(&format!("{b:02x}"));
    }
    token
}

/// Serves one page of `items`, ordered by `key` (keys must be unique).
pub fn paginate<T>(mut items: Vec<T>, key: impl Fn(&T) -> &str, request: &PageRequest) -> Result<Page<T>> {
    let after = request.after()?;
    items.sort_by(|a, b| key(a).cmp(key(b)));
    let start = match &after {
        Some(after) => items.partition_point(|i| key(i) <= after.as_str()),
        None => 0,
    };
    let size = request.size();
    let mut page: Vec<T> = items.into_iter().skip(start).collect();
    let more = page.len() > size;
    page.truncate(size);
    let next_page_token = match page.last() {
        Some(last) if more => token_for(key(last)),
        _ => String::new(),
    };
    Ok(Page { items: page, next_page_token })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_pages(items: &[String], size: u32) -> Vec<String> {
        let mut out = Vec::new();
        let mut req = PageRequest::new(size, "");
        loop {
            let page = paginate(items.to_vec(), |s| s.as_str(), &req).expect("page");
            out.extend(page.items);
            if page.next_page_token.is_empty() {
                return out;
            }
            req.page_token = page.next_page_token;
        }
    }

    #[test]
    fn every_item_once_at_every_size() {
        let items: Vec<String> = (0..23).map(|i| format!("item-{i:03}")).collect();
        for size in [0, 1, 2, 5, 22, 23, 24, 5000] {
            assert_eq!(all_pages(&items, size), items, "page size {size}");
        }
    }

    #[test]
    fn insert_between_pages_neither_repeats_nor_drops() {
        let mut items: Vec<String> = vec!["b".into(), "d".into(), "f".into()];
        let first = paginate(items.clone(), |s| s.as_str(), &PageRequest::new(2, "")).expect("page");
        assert_eq!(first.items, vec!["b", "d"]);
        items.insert(0, "a".into());
        let second = paginate(items, |s| s.as_str(), &PageRequest::new(2, first.next_page_token)).expect("page");
        assert_eq!(second.items, vec!["f"]);
        assert!(second.next_page_token.is_empty());
    }

    #[test]
    fn foreign_tokens_are_invalid_argument() {
        for token in ["garbage", "k1.zz", "k1.f", "k1.ff"] {
            let err = paginate(vec!["a".to_string()], |s| s.as_str(), &PageRequest::new(1, token)).expect_err(token);
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "{token}");
        }
    }
}
