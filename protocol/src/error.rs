//! The one error type of a provider, and its mapping to and from gRPC status.
//!
//! Providers return [`Error`]; the server turns it into a `tonic::Status` carrying
//! `google.rpc.ErrorInfo` (and `google.rpc.RetryInfo` where waiting helps) in exactly one
//! place, [`Error::into_status`]. Callers turn a status back with [`Error::from_status`].

use std::time::Duration;

use ccm_proto::ERROR_DOMAIN;
use tonic::Code;
use tonic_types::{ErrorDetails, StatusExt};

/// Stable `ErrorInfo` reasons used by the SDK and the reference providers.
pub mod reason {
    /// A request field is missing or malformed.
    pub const INVALID_ARGUMENT: &str = "INVALID_ARGUMENT";
    /// A page token the provider did not issue.
    pub const INVALID_PAGE_TOKEN: &str = "INVALID_PAGE_TOKEN";
    /// A route table the provider does not know.
    pub const UNKNOWN_ROUTE_TABLE: &str = "UNKNOWN_ROUTE_TABLE";
    /// The object does not exist.
    pub const NOT_FOUND: &str = "NOT_FOUND";
    /// An object of that name exists with other contents.
    pub const ALREADY_EXISTS: &str = "ALREADY_EXISTS";
    /// The system is not in a state that allows the call.
    pub const FAILED_PRECONDITION: &str = "FAILED_PRECONDITION";
    /// A call about a load balancer for another Service than the one it was made for (its
    /// recorded owner's UID differs): refused, never taken over or deleted.
    pub const OWNED_BY_ANOTHER_SERVICE: &str = "OWNED_BY_ANOTHER_SERVICE";
    /// Too many calls: wait for the RetryInfo delay.
    pub const RATE_LIMITED: &str = "RATE_LIMITED";
    /// A quota that waiting does not fix.
    pub const QUOTA_EXCEEDED: &str = "QUOTA_EXCEEDED";
    /// The cloud or the provider is unavailable for now.
    pub const UNAVAILABLE: &str = "UNAVAILABLE";
    /// The call ran out of time.
    pub const DEADLINE_EXCEEDED: &str = "DEADLINE_EXCEEDED";
    /// The provider does not implement the call.
    pub const UNIMPLEMENTED: &str = "UNIMPLEMENTED";
    /// Anything else.
    pub const INTERNAL: &str = "INTERNAL";
    /// The provider answered something the protocol does not allow (an INTERNAL error the
    /// caller makes of the answer; see `answer`).
    pub const INVALID_ANSWER: &str = "INVALID_ANSWER";
}

/// A provider's error. Each kind maps to one canonical gRPC code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// INVALID_ARGUMENT: the request is malformed; retrying it as is cannot succeed.
    #[error("invalid argument: {message}")]
    InvalidArgument {
        /// Stable reason, one of [`reason`] or the provider's own.
        reason: String,
        /// What is wrong, for humans.
        message: String,
    },
    /// NOT_FOUND: the named object does not exist (never used for "instance exists?").
    #[error("not found: {message}")]
    NotFound {
        /// What was not found.
        message: String,
    },
    /// ALREADY_EXISTS: an object of that name exists with other contents.
    #[error("already exists: {message}")]
    AlreadyExists {
        /// What conflicts.
        message: String,
    },
    /// FAILED_PRECONDITION: the request is valid but the system's state forbids it.
    #[error("failed precondition: {message}")]
    FailedPrecondition {
        /// Stable reason.
        reason: String,
        /// Why, for humans.
        message: String,
    },
    /// RESOURCE_EXHAUSTED with RetryInfo: throttled; retry after the delay.
    #[error("rate limited, retry after {retry_after:?}")]
    RateLimited {
        /// How long the caller must wait.
        retry_after: Duration,
    },
    /// RESOURCE_EXHAUSTED without RetryInfo: a quota is full; waiting does not help.
    #[error("quota exceeded: {message}")]
    QuotaExceeded {
        /// Which quota.
        message: String,
    },
    /// UNAVAILABLE: transient; retry, after `retry_after` when given.
    #[error("unavailable: {message}")]
    Unavailable {
        /// What is unavailable.
        message: String,
        /// How long to wait, when known.
        retry_after: Option<Duration>,
    },
    /// DEADLINE_EXCEEDED (or CANCELLED when read back): the call ran out of time.
    #[error("deadline exceeded: {message}")]
    DeadlineExceeded {
        /// What timed out.
        message: String,
    },
    /// UNIMPLEMENTED: final, never retried.
    #[error("unimplemented: {message}")]
    Unimplemented {
        /// What is not implemented.
        message: String,
    },
    /// INTERNAL or anything unexpected.
    #[error("internal error: {message}")]
    Internal {
        /// Stable reason: [`reason::INTERNAL`], or a more precise one such as
        /// [`reason::INVALID_ANSWER`].
        reason: String,
        /// What went wrong.
        message: String,
    },
}

/// Result with the provider [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// INVALID_ARGUMENT with the generic reason.
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::InvalidArgument { reason: reason::INVALID_ARGUMENT.into(), message: message.into() }
    }

    /// INVALID_ARGUMENT with a specific reason.
    pub fn invalid_argument_because(reason: &str, message: impl Into<String>) -> Self {
        Self::InvalidArgument { reason: reason.into(), message: message.into() }
    }

    /// NOT_FOUND.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::NotFound { message: message.into() }
    }

    /// ALREADY_EXISTS.
    pub fn already_exists(message: impl Into<String>) -> Self {
        Self::AlreadyExists { message: message.into() }
    }

    /// FAILED_PRECONDITION with a reason.
    pub fn failed_precondition(reason: &str, message: impl Into<String>) -> Self {
        Self::FailedPrecondition { reason: reason.into(), message: message.into() }
    }

    /// UNAVAILABLE without a delay hint.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::Unavailable { message: message.into(), retry_after: None }
    }

    /// INTERNAL.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::Internal { reason: reason::INTERNAL.into(), message: message.into() }
    }

    /// INTERNAL with a specific reason.
    pub fn internal_because(reason: &str, message: impl Into<String>) -> Self {
        Self::Internal { reason: reason.into(), message: message.into() }
    }

    /// The canonical gRPC code of this error.
    pub fn code(&self) -> Code {
        match self {
            Self::InvalidArgument { .. } => Code::InvalidArgument,
            Self::NotFound { .. } => Code::NotFound,
            Self::AlreadyExists { .. } => Code::AlreadyExists,
            Self::FailedPrecondition { .. } => Code::FailedPrecondition,
            Self::RateLimited { .. } | Self::QuotaExceeded { .. } => Code::ResourceExhausted,
            Self::Unavailable { .. } => Code::Unavailable,
            Self::DeadlineExceeded { .. } => Code::DeadlineExceeded,
            Self::Unimplemented { .. } => Code::Unimplemented,
            Self::Internal { .. } => Code::Internal,
        }
    }

    /// The stable `ErrorInfo` reason of this error.
    pub fn reason(&self) -> &str {
        match self {
            Self::InvalidArgument { reason, .. } | Self::FailedPrecondition { reason, .. } => reason,
            Self::NotFound { .. } => reason::NOT_FOUND,
            Self::AlreadyExists { .. } => reason::ALREADY_EXISTS,
            Self::RateLimited { .. } => reason::RATE_LIMITED,
            Self::QuotaExceeded { .. } => reason::QUOTA_EXCEEDED,
            Self::Unavailable { .. } => reason::UNAVAILABLE,
            Self::DeadlineExceeded { .. } => reason::DEADLINE_EXCEEDED,
            Self::Unimplemented { .. } => reason::UNIMPLEMENTED,
            Self::Internal { reason, .. } => reason,
        }
    }

    /// How long the caller should wait before retrying, when the error says.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::RateLimited { retry_after } => Some(*retry_after),
            Self::Unavailable { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    /// The same error with its retry delay, if any, at most `max`: a caller's defence against
    /// a RetryInfo of hours (a provider bug or a hostile answer) parking its work that long.
    pub fn with_retry_after_at_most(self, max: Duration) -> Self {
        match self {
            Self::RateLimited { retry_after } => Self::RateLimited { retry_after: retry_after.min(max) },
            Self::Unavailable { message, retry_after } => {
                Self::Unavailable { message, retry_after: retry_after.map(|d| d.min(max)) }
            }
            other => other,
        }
    }

    /// Whether a caller may retry the same request (after [`Error::retry_after`], if any).
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::RateLimited { .. } | Self::Unavailable { .. } | Self::DeadlineExceeded { .. })
    }

    fn message(&self) -> String {
        match self {
            Self::RateLimited { retry_after } => format!("rate limited; retry after {} ms", retry_after.as_millis()),
            Self::InvalidArgument { message, .. }
            | Self::NotFound { message }
            | Self::AlreadyExists { message }
            | Self::FailedPrecondition { message, .. }
            | Self::QuotaExceeded { message }
            | Self::Unavailable { message, .. }
            | Self::DeadlineExceeded { message }
            | Self::Unimplemented { message }
            | Self::Internal { message, .. } => message.clone(),
        }
    }

    /// The gRPC status for this error, with ErrorInfo and, where waiting helps, RetryInfo.
    pub fn into_status(self) -> tonic::Status {
        let mut details = ErrorDetails::with_error_info(self.reason(), ERROR_DOMAIN, []);
        if let Some(delay) = self.retry_after() {
            details.set_retry_info(Some(delay));
        }
        tonic::Status::with_error_details(self.code(), self.message(), details)
    }

    /// Reads a status back into an error, keeping its reason and retry delay. CANCELLED
    /// counts as a deadline (a tonic server answers CANCELLED when the deadline passes).
    pub fn from_status(status: &tonic::Status) -> Self {
        let details = status.get_error_details();
        let reason = details.error_info().map(|i| i.reason.clone()).unwrap_or_default();
        let retry_after = details.retry_info().and_then(|r| r.retry_delay);
        let message = status.message().to_string();
        let or = |r: String, default: &str| if r.is_empty() { default.to_string() } else { r };
        match status.code() {
            Code::InvalidArgument | Code::OutOfRange => {
                Self::InvalidArgument { reason: or(reason, reason::INVALID_ARGUMENT), message }
            }
            Code::NotFound => Self::NotFound { message },
            Code::AlreadyExists => Self::AlreadyExists { message },
            Code::FailedPrecondition | Code::Aborted => {
                Self::FailedPrecondition { reason: or(reason, reason::FAILED_PRECONDITION), message }
            }
            Code::ResourceExhausted => match retry_after {
                Some(retry_after) => Self::RateLimited { retry_after },
                None if reason == reason::RATE_LIMITED => Self::RateLimited { retry_after: Duration::from_secs(1) },
                None => Self::QuotaExceeded { message },
            },
            Code::Unavailable => Self::Unavailable { message, retry_after },
            Code::DeadlineExceeded | Code::Cancelled => Self::DeadlineExceeded { message },
            Code::Unimplemented => Self::Unimplemented { message },
            _ => Self::Internal { reason: or(reason, reason::INTERNAL), message: format!("{}: {message}", status.code()) },
        }
    }

    /// The error of one batch item, for an OK batch response.
    pub fn to_item_error(&self) -> ccm_proto::v1::ItemError {
        ccm_proto::v1::ItemError {
            code: self.code() as i32,
            message: self.message(),
            reason: self.reason().to_string(),
            retry_after_ms: self.retry_after().map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        }
    }

    /// Reads a batch item's error back.
    pub fn from_item_error(item: &ccm_proto::v1::ItemError) -> Self {
        let mut details = ErrorDetails::with_error_info(item.reason.clone(), ERROR_DOMAIN, []);
        if item.retry_after_ms > 0 {
            details.set_retry_info(Some(Duration::from_millis(item.retry_after_ms)));
        }
        let status = tonic::Status::with_error_details(Code::from_i32(item.code), item.message.clone(), details);
        Self::from_status(&status)
    }
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        e.into_status()
    }
}

/// The canonical upper-case name of a gRPC code, as used in metric labels.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delays_can_be_capped() {
        let max = Duration::from_secs(300);
        let hours = Error::RateLimited { retry_after: Duration::from_secs(7200) }.with_retry_after_at_most(max);
        assert_eq!(hours.retry_after(), Some(max));
        let short = Error::RateLimited { retry_after: Duration::from_secs(2) }.with_retry_after_at_most(max);
        assert_eq!(short.retry_after(), Some(Duration::from_secs(2)));
        let unavailable = Error::Unavailable { message: "x".into(), retry_after: Some(Duration::from_secs(3600)) };
        assert_eq!(unavailable.with_retry_after_at_most(max).retry_after(), Some(max));
        assert_eq!(Error::not_found("x").with_retry_after_at_most(max).retry_after(), None);
    }

    #[test]
    fn rate_limited_round_trips_with_retry_info() {
        let e = Error::RateLimited { retry_after: Duration::from_millis(1500) };
        let status = e.clone().into_status();
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(status.get_error_details().error_info().map(|i| i.reason.as_str()), Some("RATE_LIMITED"));
        assert_eq!(Error::from_status(&status), e);
        assert!(Error::from_status(&status).is_transient());
    }

    #[test]
    fn quota_is_not_transient() {
        let status = Error::QuotaExceeded { message: "table full".into() }.into_status();
        let back = Error::from_status(&status);
        assert!(matches!(back, Error::QuotaExceeded { .. }));
        assert!(!back.is_transient());
        assert_eq!(back.retry_after(), None);
    }

    #[test]
    fn cancelled_reads_as_deadline() {
        let back = Error::from_status(&tonic::Status::cancelled("timeout expired"));
        assert!(matches!(back, Error::DeadlineExceeded { .. }));
    }

    #[test]
    fn item_errors_round_trip() {
        let e = Error::Unavailable { message: "zone down".into(), retry_after: Some(Duration::from_secs(2)) };
        assert_eq!(Error::from_item_error(&e.to_item_error()), e);
        let e = Error::invalid_argument_because(reason::UNKNOWN_ROUTE_TABLE, "no table rt-x");
        assert_eq!(Error::from_item_error(&e.to_item_error()), e);
    }
}
