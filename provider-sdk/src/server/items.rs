//! What the batch calls share: sizes checked, each item checked alone, answers put in request
//! order by the lookup they name.

use ccm_proto::v1 as pb;

use crate::error::{Error, Result};
use crate::provider::Answered;
use crate::validate;

/// A batch of lookups: checks its size, gives each invalid lookup its own item error, passes
/// the valid ones to the provider in one call, and returns one answer per lookup, in request
/// order, each naming its lookup. The provider's answers are put in order by the lookups they
/// name ([`in_order`]), so a provider that sorts or groups its reads cannot hand one lookup's
/// answer to another.
pub(super) async fn batch<T>(
    lookups: &[pb::InstanceLookup],
    call: impl AsyncFnOnce(Vec<pb::InstanceLookup>) -> Result<Vec<Answered<T>>>,
) -> Result<Vec<Answered<T>>> {
    validate::batch_size(lookups.len())?;
    let (checked, valid) = checked(lookups, |l| validate::lookup(Some(l)).cloned());
    let keys: Vec<pb::LookupKey> = valid.iter().map(Answered::<()>::key).collect();
    let answers = in_order(&keys, call(valid).await?)?;
    let answers = merge("lookups", checked, answers.into_iter().map(|a| a.result).collect())?;
    Ok(lookups.iter().zip(answers).map(|(l, result)| Answered::to(l, result)).collect())
}

/// `answers` in the order of `asked`, by the lookup each names: they must name exactly the
/// lookups asked, each once; anything else is the provider's bug, refused as INTERNAL rather
/// than sent for the caller to sort out.
pub(super) fn in_order<T>(asked: &[pb::LookupKey], answers: Vec<Answered<T>>) -> Result<Vec<Answered<T>>> {
    if answers.len() != asked.len() {
        return Err(Error::internal(format!("provider answered {} of {} lookups", answers.len(), asked.len())));
    }
    let mut named: std::collections::HashMap<(String, String), Vec<Answered<T>>> = std::collections::HashMap::new();
    for a in answers.into_iter().rev() {
        named.entry((a.lookup.provider_id.clone(), a.lookup.node_name.clone())).or_default().push(a);
    }
    asked
        .iter()
        .map(|k| {
            named.get_mut(&(k.provider_id.clone(), k.node_name.clone())).and_then(Vec::pop).ok_or_else(|| {
                Error::internal(format!(
                    "provider gave no answer for node {:?} (providerID {:?}): it answered a lookup it was not given, or one twice",
                    k.node_name, k.provider_id
                ))
            })
        })
        .collect()
}

/// The object key of route `name` in table `table` ("" is the default table).
pub(super) fn route_key(table: &str, name: &str) -> String {
    format!("route {table}/{name}")
}

/// Each item's check, and the items that passed it (as `check` returns them), in order.
pub(super) fn checked<I, V>(items: &[I], check: impl Fn(&I) -> Result<V>) -> (Vec<Result<()>>, Vec<V>) {
    let mut valid = Vec::with_capacity(items.len());
    let checks = items.iter().map(|item| check(item).map(|v| valid.push(v))).collect();
    (checks, valid)
}

/// One answer per item: its check's error, or the provider's answer for it (the answers are
/// for the items that passed, in order; any other count is the provider's bug).
pub(super) fn merge<T>(what: &str, checks: Vec<Result<()>>, answers: Vec<Result<T>>) -> Result<Vec<Result<T>>> {
    let expected = checks.iter().filter(|c| c.is_ok()).count();
    if answers.len() != expected {
        return Err(Error::internal(format!("provider answered {} of {expected} {what}", answers.len())));
    }
    let mut answers = answers.into_iter();
    Ok(checks
        .into_iter()
        .map(|c| c.and_then(|()| answers.next().unwrap_or_else(|| Err(Error::internal("missing answer")))))
        .collect())
}

/// INVALID_ARGUMENT when a name is listed twice.
pub(super) fn distinct<'a>(what: &str, names: impl IntoIterator<Item = &'a str>) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    match names.into_iter().find(|n| !seen.insert(*n)) {
        Some(twice) => Err(Error::invalid_argument(format!("{what} {twice:?} is listed twice"))),
        None => Ok(()),
    }
}
