package adapter

import (
	"context"
	"errors"
	"time"

	pb "github.com/ccm-rs/go-adapter/gen/cloudprovider/v1"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/types/known/durationpb"
	cloudprovider "k8s.io/cloud-provider"
	"k8s.io/cloud-provider/api"
)

// errorDomain is the ErrorInfo domain of cloudprovider.v1.
const errorDomain = "cloudprovider.v1"

// classify maps an error of a cloudprovider.Interface implementation to a gRPC code, a stable
// reason and a RetryInfo delay (zero for none):
//   - cloudprovider.InstanceNotFound: NOT_FOUND (the instance calls read it as "absent");
//   - cloudprovider.NotImplemented: UNIMPLEMENTED, never retried;
//   - api.RetryError: RESOURCE_EXHAUSTED with its delay as RetryInfo;
//   - a context deadline or cancellation: DEADLINE_EXCEEDED or CANCELLED;
//   - anything else: UNAVAILABLE (transient) with the provider's message.
func classify(err error) (codes.Code, string, time.Duration) {
	var retry *api.RetryError
	switch {
	case errors.Is(err, cloudprovider.InstanceNotFound):
		return codes.NotFound, "NOT_FOUND", 0
	case errors.Is(err, cloudprovider.NotImplemented):
		return codes.Unimplemented, "UNIMPLEMENTED", 0
	case errors.As(err, &retry):
		delay := retry.RetryAfter()
		if delay <= 0 {
			delay = time.Second
		}
		return codes.ResourceExhausted, "RATE_LIMITED", delay
	case errors.Is(err, context.DeadlineExceeded):
		return codes.DeadlineExceeded, "DEADLINE_EXCEEDED", 0
	case errors.Is(err, context.Canceled):
		return codes.Canceled, "DEADLINE_EXCEEDED", 0
	default:
		return codes.Unavailable, "UNAVAILABLE", 0
	}
}

// toStatus turns a provider's error into the status the core reads, with ErrorInfo and,
// when the provider asked for a delay, RetryInfo. A status error passes through.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	code, reason, delay := classify(err)
	return newStatus(code, reason, err.Error(), delay)
}

func newStatus(code codes.Code, reason, message string, delay time.Duration) error {
	st := status.New(code, message)
	details := []protoadapt.MessageV1{&errdetails.ErrorInfo{Reason: reason, Domain: errorDomain}}
	if delay > 0 {
		details = append(details, &errdetails.RetryInfo{RetryDelay: durationpb.New(delay)})
	}
	if withDetails, err := st.WithDetails(details...); err == nil {
		st = withDetails
	}
	return st.Err()
}

func invalidArgument(reason, message string) error {
	return newStatus(codes.InvalidArgument, reason, message, 0)
}

func unimplemented(message string) error {
	return newStatus(codes.Unimplemented, "UNIMPLEMENTED", message, 0)
}

// itemError is the per-item error of a batch answer: a status error (one of this adapter's
// own answers) keeps its code, reason and delay; a provider's error is classified.
func itemError(err error) *pb.ItemError {
	if st, ok := status.FromError(err); ok {
		item := &pb.ItemError{Code: int32(st.Code()), Message: st.Message(), Reason: st.Code().String()}
		for _, d := range st.Details() {
			switch d := d.(type) {
			case *errdetails.ErrorInfo:
				item.Reason = d.GetReason()
			case *errdetails.RetryInfo:
				item.RetryAfterMs = uint64(d.GetRetryDelay().AsDuration().Milliseconds())
			}
		}
		return item
	}
	code, reason, delay := classify(err)
	return &pb.ItemError{Code: int32(code), Message: err.Error(), Reason: reason, RetryAfterMs: uint64(delay.Milliseconds())}
}
