package fuse

import (
	"fmt"
	"io"
	"math"
	"slices"
	"sync/atomic"
	"syscall"
	"time"
)

// Request metrics (ServerOptions.Metrics). Each Queue counts into its own
// queueStats, written only by the goroutine serving it, so counting shares
// no cache line with another ring or worker; a scrape sums them. With
// metrics off a Queue has no stats and Serve pays one nil check.

// latencyBounds are the upper bounds of the latency histogram's buckets,
// from a cached GETATTR to a slow synchronous write.
var latencyBounds = [...]time.Duration{
	10 * time.Microsecond, 25 * time.Microsecond, 50 * time.Microsecond,
	100 * time.Microsecond, 250 * time.Microsecond, 500 * time.Microsecond,
	time.Millisecond, 2500 * time.Microsecond, 5 * time.Millisecond,
	10 * time.Millisecond, 25 * time.Millisecond, 100 * time.Millisecond,
	time.Second,
}

type opStats struct {
	count   atomic.Uint64
	errors  atomic.Uint64
	nanos   atomic.Uint64
	buckets [len(latencyBounds) + 1]atomic.Uint64 // the last is +Inf
}

// queueStats counts by opcode up to numOps; higher opcodes are counted
// together as "unknown" (index 0, which no opcode uses).
type queueStats struct {
	ops          [numOps]opStats
	bytesRead    atomic.Uint64 // READ payload returned to the guest
	bytesWritten atomic.Uint64 // WRITE payload the host accepted
}

// record counts one request of opcode op, flags its entry's. errno is its
// answer (0, or noReply for requests without one); moved the file data it
// moved.
func (st *queueStats) record(op uint32, flags opFlags, errno syscall.Errno, d time.Duration, moved int) {
	if op >= numOps {
		op = 0
	}
	o := &st.ops[op]
	o.count.Add(1)
	if errno != 0 && errno != noReply {
		o.errors.Add(1)
	}
	o.nanos.Add(uint64(d))
	b := 0
	for b < len(latencyBounds) && d > latencyBounds[b] {
		b++
	}
	o.buckets[b].Add(1)
	switch {
	case flags&readsFile != 0:
		st.bytesRead.Add(uint64(moved))
	case flags&writesFile != 0:
		st.bytesWritten.Add(uint64(moved))
	}
}

// newStats registers the stats of a new Queue, or returns nil with metrics
// off.
func (s *Server) newStats() *queueStats {
	if !s.opts.Metrics {
		return nil
	}
	st := new(queueStats)
	s.mu.Lock()
	s.stats = append(s.stats, st)
	s.mu.Unlock()
	return st
}

// WriteMetrics writes the request metrics in the Prometheus text format
// (version 0.0.4): per opcode, requests, errors and a latency histogram;
// bytes read and written. Opcodes never seen are left out.
func (s *Server) WriteMetrics(w io.Writer) error {
	s.mu.Lock()
	all := slices.Clone(s.stats)
	s.mu.Unlock()

	type opSum struct {
		count, errors, nanos uint64
		buckets              [len(latencyBounds) + 1]uint64
	}
	var sums [numOps]opSum
	var read, written uint64
	for _, st := range all {
		for op := range st.ops {
			o, sum := &st.ops[op], &sums[op]
			// record adds to count before the bucket; loading the
			// buckets first keeps every cumulative bucket at or below
			// the count (the +Inf bucket, written as the count).
			for b := range o.buckets {
				sum.buckets[b] += o.buckets[b].Load()
			}
			sum.nanos += o.nanos.Load()
			sum.errors += o.errors.Load()
			sum.count += o.count.Load()
		}
		read += st.bytesRead.Load()
		written += st.bytesWritten.Load()
	}

	ew := &errWriter{w: w}
	name := func(op int) string {
		if op == 0 {
			return "unknown"
		}
		return OpName(uint32(op))
	}
	ew.printf("# HELP govirtiofsd_fuse_requests_total FUSE requests served, by opcode.\n# TYPE govirtiofsd_fuse_requests_total counter\n")
	for op := range sums {
		if sums[op].count != 0 {
			ew.printf("govirtiofsd_fuse_requests_total{opcode=%q} %d\n", name(op), sums[op].count)
		}
	}
	ew.printf("# HELP govirtiofsd_fuse_errors_total FUSE requests answered with an error, by opcode.\n# TYPE govirtiofsd_fuse_errors_total counter\n")
	for op := range sums {
		if sums[op].count != 0 {
			ew.printf("govirtiofsd_fuse_errors_total{opcode=%q} %d\n", name(op), sums[op].errors)
		}
	}
	ew.printf("# HELP govirtiofsd_fuse_request_duration_seconds Time from decoding a request to its reply, by opcode.\n# TYPE govirtiofsd_fuse_request_duration_seconds histogram\n")
	for op := range sums {
		sum := &sums[op]
		if sum.count == 0 {
			continue
		}
		var cum uint64
		for b, bound := range latencyBounds {
			cum += sum.buckets[b]
			ew.printf("govirtiofsd_fuse_request_duration_seconds_bucket{opcode=%q,le=%q} %d\n", name(op), seconds(bound), cum)
		}
		ew.printf("govirtiofsd_fuse_request_duration_seconds_bucket{opcode=%q,le=\"+Inf\"} %d\n", name(op), sum.count)
		ew.printf("govirtiofsd_fuse_request_duration_seconds_sum{opcode=%q} %s\n", name(op), seconds(time.Duration(sum.nanos)))
		ew.printf("govirtiofsd_fuse_request_duration_seconds_count{opcode=%q} %d\n", name(op), sum.count)
	}
	ew.printf("# HELP govirtiofsd_read_bytes_total Bytes returned to the guest by READ.\n# TYPE govirtiofsd_read_bytes_total counter\ngovirtiofsd_read_bytes_total %d\n", read)
	ew.printf("# HELP govirtiofsd_written_bytes_total Bytes written to host files by WRITE.\n# TYPE govirtiofsd_written_bytes_total counter\ngovirtiofsd_written_bytes_total %d\n", written)
	return ew.err
}

func seconds(d time.Duration) string {
	s := d.Seconds()
	if s == math.Trunc(s) {
		return fmt.Sprintf("%.0f", s)
	}
	return fmt.Sprintf("%g", s)
}

// errWriter keeps the first write error so a scrape is written without an
// error check per line.
type errWriter struct {
	w   io.Writer
	err error
}

func (e *errWriter) printf(format string, a ...any) {
	if e.err == nil {
		_, e.err = fmt.Fprintf(e.w, format, a...)
	}
}
