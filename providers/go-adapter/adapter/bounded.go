package adapter

import (
	"context"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
)

// minProviderDeadline is the least time a provider call gets, whatever the request's deadline.
const minProviderDeadline = 30 * time.Second

// bounded runs one provider call on a context of its own and answers when the call ends or
// the request's context does, whichever is first. Providers that batch cloud calls (the AWS
// provider coalesces DescribeInstances) run a batch on the context of whichever request
// started it: handing them the request's context would let one short-deadline or cancelled
// request fail every other request in its batch. The call's own context keeps the request's
// values and lasts at least minProviderDeadline; the caller still gets DEADLINE_EXCEEDED
// (or CANCELLED) at its own deadline.
func bounded[T any](ctx context.Context, call func(context.Context) (T, error)) (T, error) {
	timeout := minProviderDeadline
	if deadline, ok := ctx.Deadline(); ok && time.Until(deadline) > timeout {
		timeout = time.Until(deadline)
	}
	callCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
	type result struct {
		value T
		err   error
	}
	done := make(chan result, 1)
	go func() {
		defer cancel()
		v, err := call(callCtx)
		done <- result{v, err}
	}()
	select {
	case r := <-done:
		return r.value, r.err
	case <-ctx.Done():
		var zero T
		if ctx.Err() == context.DeadlineExceeded {
			return zero, newStatus(codes.DeadlineExceeded, "DEADLINE_EXCEEDED", "the request's deadline passed before the provider answered", 0)
		}
		return zero, newStatus(codes.Canceled, "DEADLINE_EXCEEDED", "the request was cancelled before the provider answered", 0)
	}
}

// maxBatch is the most items one batch or bulk call carries (the protocol's limit).
const maxBatch = 500

// each runs do(0) … do(n-1), at most limit at a time, and returns when all have.
func each(n, limit int, do func(i int)) {
	if limit <= 0 {
		limit = 1
	}
	slots := make(chan struct{}, limit)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		slots <- struct{}{}
		wg.Add(1)
		go func(i int) {
			defer func() { <-slots; wg.Done() }()
			do(i)
		}(i)
	}
	wg.Wait()
}
