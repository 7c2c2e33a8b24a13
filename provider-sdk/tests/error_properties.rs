//! The error mapping from `tonic::Status` reads whatever a provider sends: any code, any
//! message, any bytes as details. It never panics, and what the SDK sends it reads back.

use std::time::Duration;

use ccm_provider_sdk::Error;
use proptest::prelude::*;

proptest! {
    #[test]
    fn any_status_is_read(code in 0i32..20, message in ".{0,64}", details in proptest::collection::vec(any::<u8>(), 0..64)) {
        let status = tonic::Status::with_details(tonic::Code::from_i32(code), message, details.into());
        let error = Error::from_status(&status);
        // UNIMPLEMENTED and the codes of bad requests are never retried as if transient.
        if matches!(status.code(), tonic::Code::Unimplemented | tonic::Code::InvalidArgument | tonic::Code::NotFound) {
            prop_assert!(!error.is_transient(), "{:?} from {:?}", error, status.code());
        }
    }

    #[test]
    fn what_the_sdk_sends_it_reads_back(ms in 0u64..86_400_000, message in "[a-zA-Z0-9 .:-]{0,64}") {
        let limited = Error::RateLimited { retry_after: Duration::from_millis(ms) };
        prop_assert_eq!(Error::from_status(&limited.clone().into_status()), limited);
        let unavailable = Error::unavailable(message.clone());
        prop_assert_eq!(Error::from_status(&unavailable.clone().into_status()), unavailable);
        let not_found = Error::not_found(message);
        prop_assert_eq!(Error::from_status(&not_found.clone().into_status()), not_found);
    }
}
