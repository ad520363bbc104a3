package main

import (
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/govirtiofsd/govirtiofsd/internal/vhostuser"
	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// TestWatcherProcs: the daemon's GOMAXPROCS is the CPUs plus the most rings
// any back end started: rings 0-2 started, CPUs+3; stopping and restarting
// a ring, or starting fewer on another back end, changes nothing; and the
// default worker budget still counts the CPUs alone.
func TestWatcherProcs(t *testing.T) {
	procs.Lock()
	cpus, watched := procs.cpus, procs.watched // 0 unless run before (-count)
	procs.Unlock()
	if watched == 0 {
		cpus = runtime.GOMAXPROCS(0)
	}
	workers := max(cpus-1, 1)
	if got := defaultWorkers(); got != workers {
		t.Errorf("default workers %d with %d CPUs, want %d", got, cpus, workers)
	}
	d := startBackend(t, 2)
	want := cpus + max(3, watched)
	for i := range 3 {
		// Answered after every message before it.
		at, err := d.StopQueue(2)
		if err != nil {
			t.Fatal(err)
		}
		if got := runtime.GOMAXPROCS(0); got != want {
			t.Fatalf("rings 0-2 started, ring 2 stopped %d times: GOMAXPROCS %d, want %d", i+1, got, want)
		}
		if err := d.RestartQueue(2, at, false); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := startBackend(t, 1).StopQueue(1); err != nil {
		t.Fatal(err)
	}
	if got := runtime.GOMAXPROCS(0); got != want {
		t.Errorf("a second back end with rings 0-1 started: GOMAXPROCS %d, want %d", got, want)
	}
	if got := defaultWorkers(); got != workers {
		t.Errorf("default workers %d with watchers, want %d", got, workers)
	}
}

// startBackend serves a back end with rings request rings, the daemon's
// hook for the Ps, and returns a front end that started every ring. No
// request is sent: the servers need no handler.
func startBackend(t *testing.T, rings int) *vmm.Device {
	t.Helper()
	b, err := vhostuser.NewBackend(vhostuser.Config{RequestQueues: rings, Tag: "procs",
		Logger:       slog.New(slog.NewTextHandler(io.Discard, nil)),
		RingsWatched: reserveWatcherProcs,
		Handler:      vhostuser.HandlerFunc(func(int) vhostuser.RequestHandler { return nil })})
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "vhost.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- b.ServeFirst(l) }()
	opts := vmm.DefaultOptions()
	opts.Queues = 1 + rings
	d, err := vmm.Start(sock, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		d.Close()
		if err := <-served; err != nil {
			t.Error(err)
		}
	})
	return d
}
