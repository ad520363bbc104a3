package vhostuser

import "fmt"

// unlock releases rn.mu after checking the counting rules (doc.go) where
// checkRules is set (rules_checked.go); elsewhere it is mu.Unlock.
func (rn *runner) unlock() {
	if checkRules {
		if rule := rn.brokenRule(); rule != "" {
			panic(fmt.Sprintf("vhostuser: ring %d broke a scheduling rule: %s (servers %d, parked %d, awake %d, live %d, extras %d, busy workers %d of %d, watching %t, stopping %t)",
				rn.r.index, rule, len(rn.servers), len(rn.parked), rn.awake, rn.live, rn.extras,
				rn.r.b.busyWorkers.Load(), rn.r.b.cfg.Workers, rn.watching, rn.stopping.Load()))
		}
	}
	rn.mu.Unlock()
}

// brokenRule returns the first rule rn breaks, "" if none. rn.mu is held.
func (rn *runner) brokenRule() string {
	n, started, parkedStarted, stopping := len(rn.servers), 0, 0, rn.stopping.Load()
	for i, s := range rn.servers {
		if s.started {
			if i != started || i >= len(rn.r.slots) || s.slot != rn.r.slots[i] {
				return "servers start in index order, each with its ring's slot for its index"
			}
			started++
		}
	}
	for j, s := range rn.parked {
		switch {
		case !s.started && j > 0 && (rn.parked[j-1].started || rn.parked[j-1].index <= s.index):
			return "the servers never started lie under the parked ones, each once, the lowest index on top"
		case s.started && (s.mem != nil || len(s.wake) != 0):
			return "a parked server holds no memory table and no wake-up"
		case s.started:
			parkedStarted++
		}
	}
	for _, c := range [...]struct {
		broken bool
		rule   string
	}{
		{rn.live > started || !stopping && rn.live != started, "no server exits before the ring stops"},
		{rn.live != rn.awake+parkedStarted, "live = awake + the parked servers that started, each parked once"},
		{!stopping && len(rn.parked)+rn.awake != n, "parked + awake = servers until the ring stops"},
		{rn.awake == 0 && (!stopping || rn.watching), "a server is awake until the ring stops, the watcher among them"},
		{rn.extras < 0 || rn.extras > max(rn.awake-1, 0), "0 ≤ extras ≤ awake − 1"},
		{int32(rn.extras) > rn.r.b.busyWorkers.Load(), "extras ≤ the back end's busy workers"},
		{rn.live == 0 && len(rn.parked) > 0, "a ring whose servers all exited has none parked"},
	} {
		if c.broken {
			return c.rule
		}
	}
	return ""
}

// checkWorkers checks, where the rules are checked, that the back end's
// busy workers are the units its rings hold, at most Workers. It holds
// every serving ring's lock meanwhile: no unit is then on its way between
// the budget and a ring.
func (b *Backend) checkWorkers() {
	if !checkRules {
		return
	}
	held := 0
	for _, r := range b.rings {
		if r != nil && r.run != nil {
			r.run.mu.Lock()
			defer r.run.unlock()
			held += r.run.extras
		}
	}
	if busy := int(b.busyWorkers.Load()); busy != held || held > b.cfg.Workers {
		panic(fmt.Sprintf("vhostuser: the back end broke a scheduling rule: busy workers %d = units the rings hold %d ≤ Workers %d",
			busy, held, b.cfg.Workers))
	}
}
