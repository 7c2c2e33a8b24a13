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
	return running(ctx, func() (T, error) {
		defer cancel()
		return call(callCtx)
	})
}

// running starts call and answers when it ends or ctx does, whichever is first (the call goes
// on to its end either way).
func running[T any](ctx context.Context, call func() (T, error)) (T, error) {
	type result struct {
		value T
		err   error
	}
	done := make(chan result, 1)
	go func() {
		defer func() {
			if r := recover(); r != nil {
				var zero T
				done <- result{zero, panicked("a provider call", r)}
			}
		}()
		v, err := call()
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
	var once sync.Once
	var first any
	for i := 0; i < n; i++ {
		slots <- struct{}{}
		wg.Add(1)
		go func(i int) {
			defer func() {
				if r := recover(); r != nil {
					once.Do(func() { first = r })
				}
				<-slots
				wg.Done()
			}()
			do(i)
		}(i)
	}
	wg.Wait()
	// A panic of one item goes on in the caller's goroutine, which recovers it (running).
	if first != nil {
		panic(first)
	}
}

// objectLocks serialises the mutations of one cloud object (a load balancer, a route). A
// mutation outlives its request (bounded gives the provider at least minProviderDeadline, and
// cloud calls cannot be taken back), so a caller that timed out and retried would otherwise
// have two mutations of the same object running at once: the second waits for the first to
// end, or answers UNAVAILABLE (MUTATION_IN_PROGRESS) when its own deadline comes first.
type objectLocks struct {
	mu   sync.Mutex
	held map[string]chan struct{}
}

func newObjectLocks() *objectLocks {
	return &objectLocks{held: map[string]chan struct{}{}}
}

// acquire waits until no mutation of key runs and takes it; release gives it back.
func (l *objectLocks) acquire(ctx context.Context, key string) (release func(), err error) {
	// Give up a little before the request's deadline, so that the caller hears why.
	giveUp := ctx.Done()
	if deadline, ok := ctx.Deadline(); ok {
		wait := time.Until(deadline)
		wait -= min(wait/10, time.Second)
		waiting, cancel := context.WithTimeout(ctx, wait)
		defer cancel()
		giveUp = waiting.Done()
	}
	for {
		l.mu.Lock()
		busy, taken := l.held[key]
		if !taken {
			mine := make(chan struct{})
			l.held[key] = mine
			l.mu.Unlock()
			return func() {
				l.mu.Lock()
				delete(l.held, key)
				l.mu.Unlock()
				close(mine)
			}, nil
		}
		l.mu.Unlock()
		select {
		case <-busy:
		case <-giveUp:
			return nil, newStatus(codes.Unavailable, "MUTATION_IN_PROGRESS",
				"an earlier mutation of "+key+" is still running in the provider (its caller timed out); retry later", time.Second)
		}
	}
}

// mutation runs a call that changes the cloud object key: at most one runs per object, from
// its start until the provider call returns (not until its caller gave up), and on the
// request's own context, unlike bounded's reads: when the caller gives up (its deadline, a
// leader that lost its lease and exited) the provider's cloud calls are cancelled rather than
// left running beside the next leader's. The core gives mutations a long deadline
// (--provider-mutation-timeout) for slow creates, and never retries one that timed out
// inside the call.
func mutation[T any](ctx context.Context, locks *objectLocks, key string, call func(context.Context) (T, error)) (T, error) {
	release, err := locks.acquire(ctx, key)
	if err != nil {
		var zero T
		return zero, err
	}
	return running(ctx, func() (T, error) {
		defer release()
		return call(ctx)
	})
}
