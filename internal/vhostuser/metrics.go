package vhostuser

import (
	"fmt"
	"io"
	"sync/atomic"
)

// ringStats are one ring's counters for Config.Metrics, kept outside the
// vring (which the message loop creates and changes) so that a scrape reads
// only atomics. The ring's servers update them once per snapshot or per
// chain; with metrics off a runner has none and pays one nil check.
type ringStats struct {
	active    atomic.Bool   // started and enabled: its servers serve it
	depth     atomic.Uint32 // chains waiting at the last snapshot, less those popped since
	popped    atomic.Uint64
	completed atomic.Uint64 // answered in the used ring (or, a bad head, dropped)
}

// took counts a chain popped, which the guest no longer has waiting. Its
// one writer is the ring's server holding the runner's lock.
func (st *ringStats) took() {
	st.popped.Add(1)
	if d := st.depth.Load(); d > 0 {
		st.depth.Store(d - 1)
	}
}

func (b *Backend) ringStats(index int) *ringStats {
	if b.stats == nil {
		return nil
	}
	return &b.stats[index]
}

// WriteMetrics writes the rings' state in the Prometheus text format: per
// ring that has served, the requests taken, completed, in flight (taken,
// not yet completed) and the queue depth (published by the guest, not yet
// taken). It may run concurrently with everything else.
func (b *Backend) WriteMetrics(w io.Writer) error {
	if b.stats == nil {
		return nil
	}
	type row struct {
		index                          int
		active                         bool
		depth, inflight, pop, complete uint64
	}
	var rows []row
	for i := range b.stats {
		st := &b.stats[i]
		complete := st.completed.Load()
		pop := st.popped.Load()
		if pop == 0 && !st.active.Load() {
			continue
		}
		r := row{index: i, active: st.active.Load(), pop: pop, complete: complete}
		if pop > complete {
			r.inflight = pop - complete
		}
		if r.active {
			r.depth = uint64(st.depth.Load())
		}
		rows = append(rows, r)
	}
	var err error
	p := func(format string, a ...any) {
		if err == nil {
			_, err = fmt.Fprintf(w, format, a...)
		}
	}
	metric := func(name, kind, help string, v func(row) uint64) {
		p("# HELP %s %s\n# TYPE %s %s\n", name, help, name, kind)
		for _, r := range rows {
			p("%s{queue=\"%d\"} %d\n", name, r.index, v(r))
		}
	}
	metric("govirtiofsd_queue_requests_total", "counter", "Requests taken from the ring.", func(r row) uint64 { return r.pop })
	metric("govirtiofsd_queue_completed_total", "counter", "Requests returned on the used ring.", func(r row) uint64 { return r.complete })
	metric("govirtiofsd_queue_inflight", "gauge", "Requests taken and not yet returned.", func(r row) uint64 { return r.inflight })
	metric("govirtiofsd_queue_depth", "gauge", "Requests the guest published that the daemon has not taken yet (at the ring's last look).", func(r row) uint64 { return r.depth })
	metric("govirtiofsd_queue_active", "gauge", "1 while a goroutine serves the ring.", func(r row) uint64 {
		if r.active {
			return 1
		}
		return 0
	})
	p("# HELP govirtiofsd_workers_busy Extra ring servers awake, out of the --thread-pool-size budget.\n# TYPE govirtiofsd_workers_busy gauge\ngovirtiofsd_workers_busy %d\n", max(b.busyWorkers.Load(), 0))
	return err
}
