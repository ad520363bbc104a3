package launch

import (
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

func startSh(t *testing.T, script string) *Process {
	t.Helper()
	p, err := Spec{Bin: "/bin/sh", Args: []string{"-c", script}, Group: true, Log: filepath.Join(t.TempDir(), "log"), Header: true}.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	return p
}

// A process that exits before its socket appears fails WaitSocket at once,
// with its exit and the end of its log; its status is its exit code.
func TestWaitSocketExit(t *testing.T) {
	p := startSh(t, "echo starting; exit 3")
	err := p.WaitSocket(filepath.Join(t.TempDir(), "sock"), time.Minute)
	if err == nil || !strings.Contains(err.Error(), "exit status 3") || !strings.Contains(err.Error(), "starting") {
		t.Errorf("WaitSocket: %v; want the exit and the log", err)
	}
	if st := p.Status(); st != (Status{Code: 3}) {
		t.Errorf("status %+v, want code 3", st)
	}
	if !strings.HasPrefix(p.Log(), "# /bin/sh -c 'echo starting; exit 3'\n") {
		t.Errorf("log %q: no command line first", p.Log())
	}
}

// Stop goes through its steps to SIGKILL when the process ignores them,
// and the status names the signal.
func TestStopEscalates(t *testing.T) {
	p := startSh(t, "trap '' TERM; echo ready; while :; do sleep 1; done")
	for !strings.Contains(p.Log(), "ready") {
		time.Sleep(time.Millisecond)
	}
	start := time.Now()
	p.Stop(10*time.Millisecond, Step{Signal: syscall.SIGTERM, Wait: 50 * time.Millisecond})
	if p.Running() || time.Since(start) > 10*time.Second {
		t.Fatalf("still running after Stop (%v)", time.Since(start))
	}
	if st := p.Status(); st != (Status{Code: -1, Signal: syscall.SIGKILL}) {
		t.Errorf("status %+v, want killed by SIGKILL", st)
	}
}

func TestLineArgs(t *testing.T) {
	for _, tc := range []struct {
		line Line
		want string
	}{
		{Line{Kind: Ours, Socket: "s", Share: "d", Extra: []string{"-x"}}, "--socket-path s --shared-dir d -x"},
		{Line{Kind: Reference, Socket: "s", Share: "d", Cache: "never"}, "--socket-path=s -o source=d -o cache=none"},
		{Line{Kind: Rust, Socket: "s", Share: "d", Cache: "never"}, "--socket-path s --shared-dir d --cache never"},
	} {
		if got := tc.line.Args(); !slices.Equal(got, strings.Fields(tc.want)) {
			t.Errorf("%+v: %q, want %q", tc.line, got, tc.want)
		}
	}
}
