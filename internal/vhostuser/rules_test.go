package vhostuser

import (
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/govirtiofsd/govirtiofsd/internal/virtqueue"
)

// ruleRing is a runner's counts, to build a runner in any state.
type ruleRing struct {
	started, parked           []int // servers started; parked, bottom first
	awake, live, extras, busy int
	watching, stopping        bool
}

// newRuleRunner builds ring 1 of a back end with 3 workers, its runner
// with the counts of rr and no goroutine.
func newRuleRunner(t *testing.T, rr ruleRing) *runner {
	t.Helper()
	b, err := NewBackend(Config{RequestQueues: 1, Workers: 3, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Handler: HandlerFunc(func(int) RequestHandler { return echoHandler{} })})
	if err != nil {
		t.Fatal(err)
	}
	r := newVring(b, 1)
	rn := &runner{r: r, awake: rr.awake, live: rr.live, extras: rr.extras, watching: rr.watching}
	rn.stopping.Store(rr.stopping)
	b.busyWorkers.Store(int32(rr.busy))
	r.slots = make([]*slot, 4)
	for i := range 4 {
		rn.servers = append(rn.servers, &server{rn: rn, index: i, wake: make(chan struct{}, 1)})
	}
	for _, i := range rr.started {
		r.slots[i] = &slot{}
		rn.servers[i].slot, rn.servers[i].started = r.slots[i], true
	}
	for _, i := range rr.parked {
		rn.parked = append(rn.parked, rn.servers[i])
	}
	return rn
}

// TestRulesNamed: each counting rule, broken in a runner's counts, is the
// one brokenRule names, and the states the scheduler goes through break
// none.
func TestRulesNamed(t *testing.T) {
	// Servers 0-2 started, 1 parked, 3 never started: 0 and 2 awake,
	// one of them on a budget unit.
	valid := ruleRing{started: []int{0, 1, 2}, parked: []int{3, 1}, awake: 2, live: 3, extras: 1, busy: 1, watching: true}
	stopping := valid
	stopping.stopping, stopping.live, stopping.awake, stopping.extras = true, 2, 1, 0 // one server exited
	for _, tc := range []struct {
		name  string
		rr    ruleRing
		edit  func(rn *runner)
		broke string // "" for none
	}{
		{"valid", valid, nil, ""},
		{"valid-stopping", stopping, nil, ""},
		{"started-out-of-order", valid, func(rn *runner) { rn.servers[1].started = false }, "servers start in index order"},
		{"foreign-slot", valid, func(rn *runner) { rn.servers[2].slot = &slot{} }, "servers start in index order"},
		{"unstarted-above-parked", valid, func(rn *runner) { rn.parked[0], rn.parked[1] = rn.parked[1], rn.parked[0] },
			"the servers never started lie under the parked ones"},
		{"parked-with-memory", valid, func(rn *runner) { rn.servers[1].mem = &virtqueue.GuestMemory{} },
			"a parked server holds no memory table"},
		{"parked-with-wake-up", valid, func(rn *runner) { rn.servers[1].wake <- struct{}{} },
			"a parked server holds no memory table and no wake-up"},
		{"exited-before-stop", valid, func(rn *runner) { rn.live--; rn.awake-- }, "no server exits before the ring stops"},
		{"parked-twice", valid, func(rn *runner) { rn.parked = append(rn.parked, rn.servers[1]) },
			"live = awake + the parked servers that started"},
		{"lost-server", valid, func(rn *runner) { rn.parked = rn.parked[1:] }, "parked + awake = servers"},
		{"none-awake", ruleRing{started: []int{0, 1}, parked: []int{3, 2, 1, 0}, live: 2}, nil,
			"a server is awake until the ring stops"},
		{"watcher-asleep", ruleRing{started: []int{0}, live: 0, stopping: true, watching: true}, nil,
			"a server is awake until the ring stops, the watcher among them"},
		{"extras-beyond-awake", valid, func(rn *runner) { rn.extras = 2 }, "0 ≤ extras ≤ awake − 1"},
		{"extras-negative", valid, func(rn *runner) { rn.extras = -1 }, "0 ≤ extras ≤ awake − 1"},
		{"extras-not-in-budget", valid, func(rn *runner) { rn.r.b.busyWorkers.Store(0) }, "extras ≤ the back end's busy workers"},
		{"parked-after-exit", ruleRing{started: []int{0}, parked: []int{3}, stopping: true}, nil,
			"a ring whose servers all exited has none parked"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rn := newRuleRunner(t, tc.rr)
			if tc.edit != nil {
				tc.edit(rn)
			}
			got := rn.brokenRule()
			if tc.broke == "" && got != "" || !strings.HasPrefix(got, tc.broke) {
				t.Errorf("broke %q, want %q", got, tc.broke)
			}
		})
	}
}

// TestRulesChecked: where the rules are checked (every -race build), a
// rule broken in a serving back end stops the process at the runner's next
// transition, naming the rule, and at the message loop's next stop of a
// ring when the back end's busy workers are not the rings' units. The
// breaks run in a child process, which they end.
func TestRulesChecked(t *testing.T) {
	if !checkRules {
		t.Skip("the rules are checked in -race builds and with -tags schedcheck")
	}
	if mode := os.Getenv("VHOSTUSER_BREAK_RULE"); mode != "" {
		breakRule(t, mode)
		return
	}
	for mode, want := range map[string]string{
		"transition": "vhostuser: ring 1 broke a scheduling rule: extras ≤ the back end's busy workers (servers 2, parked 1, awake 1, live 1, extras 0, busy workers -1 of 1",
		"stop":       "vhostuser: the back end broke a scheduling rule: busy workers 1 = units the rings hold 0 ≤ Workers 1",
	} {
		t.Run(mode, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestRulesChecked$", "-test.count=1")
			cmd.Env = append(os.Environ(), "VHOSTUSER_BREAK_RULE="+mode)
			out, err := cmd.CombinedOutput()
			if err == nil || !strings.Contains(string(out), want) {
				t.Errorf("child: %v, want a panic with %q; output:\n%s", err, want, out)
			}
		})
	}
}

// breakRule serves a probe, breaks the back end's count of busy workers and
// makes the back end look at it.
func breakRule(t *testing.T, mode string) {
	p, d := startProbe(t, 1)
	b := p.b
	submit(t, d, [][40]byte{request(0, false, 0)})
	switch mode {
	case "transition":
		b.busyWorkers.Add(-1)
		submit(t, d, [][40]byte{request(0, false, 0)})
	case "stop":
		b.busyWorkers.Add(1)
		d.StopQueue(1)
	}
	time.Sleep(5 * time.Second)
	t.Fatalf("%s: the broken rule went unnoticed", mode)
}
