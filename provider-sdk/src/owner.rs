//! A load balancer belongs to the Service it was made for.
//!
//! The core keys every load balancer call by a name it derives from the Service's UID, and
//! never uses a name that is not the Service's own. A provider keeps the other half of that
//! promise: it records the UID a load balancer was made for (every request carries it) and
//! refuses a call for any other Service under that name, so that no bug, no user-written
//! annotation and no second cluster in the same account can make one Service read, take over
//! or delete another's load balancer. The conformance suite checks it
//! (`load-balancers.other-services-name`).

use crate::proto as pb;
use crate::{Error, Result, reason};

/// Refuses a call for the Service `asking` about the load balancer `load_balancer_name`
/// when the provider recorded another Service (`recorded_uid`) as its owner: a
/// FAILED_PRECONDITION with reason [`reason::OWNED_BY_ANOTHER_SERVICE`]. A load balancer
/// without a recorded owner (`""`: made before owners were recorded) is anyone's; call it
/// with what the provider has before it changes or answers anything:
///
/// ```
/// # use ccm_provider_sdk::{owner, proto as pb};
/// let made_for = "3f1c…-uid-of-the-owner";
/// let asking = pb::LoadBalancerService { uid: "9a2e…-another".into(), ..Default::default() };
/// assert!(owner::check("lb-1", made_for, &asking).is_err());
/// ```
pub fn check(load_balancer_name: &str, recorded_uid: &str, asking: &pb::LoadBalancerService) -> Result<()> {
    if recorded_uid.is_empty() || recorded_uid == asking.uid {
        return Ok(());
    }
    Err(Error::failed_precondition(
        reason::OWNED_BY_ANOTHER_SERVICE,
        format!(
            "load balancer {load_balancer_name} belongs to another Service (UID {recorded_uid}), not to {}/{} (UID {})",
            asking.namespace, asking.name, asking.uid
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(uid: &str) -> pb::LoadBalancerService {
        pb::LoadBalancerService { uid: uid.into(), namespace: "ns".into(), name: "svc".into(), ..Default::default() }
    }

    #[test]
    fn only_the_recorded_owner_may_call() {
        assert!(check("lb", "uid-a", &service("uid-a")).is_ok());
        assert!(check("lb", "", &service("uid-b")).is_ok(), "no owner recorded: anyone's");
        let refused = check("lb", "uid-a", &service("uid-b")).expect_err("another Service");
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
        assert_eq!(refused.reason(), reason::OWNED_BY_ANOTHER_SERVICE);
        assert!(!refused.is_transient(), "retrying does not make it theirs");
    }
}
