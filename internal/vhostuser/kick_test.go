package vhostuser

import (
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestKickWatch: a wait ends when the ring is kicked (and consumes the
// kick), and every wait ends once interrupt has been called.
func TestKickWatch(t *testing.T) {
	kick, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(kick)
	k, err := newKickWatch(kick)
	if err != nil {
		t.Fatal(err)
	}
	defer k.close()

	one := []byte{1, 0, 0, 0, 0, 0, 0, 0}
	waited := make(chan error, 1)
	go func() { waited <- k.wait() }()
	select {
	case err := <-waited:
		t.Fatalf("wait returned before any kick: %v", err)
	case <-time.After(20 * time.Millisecond):
	}
	if _, err := unix.Write(kick, one); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-waited:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("wait did not end on a kick")
	}
	var buf [8]byte
	if _, err := unix.Read(kick, buf[:]); err != unix.EAGAIN {
		t.Errorf("kick not consumed by wait: read %v", err)
	}

	go func() { waited <- k.wait() }()
	time.Sleep(10 * time.Millisecond)
	k.interrupt()
	for i := range 3 {
		select {
		case err := <-waited:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("wait %d did not end after interrupt", i)
		}
		go func() { waited <- k.wait() }()
	}
	<-waited
}

// reserveTestProcs gives the test process the daemon's Ps (cmd/govirtiofsd,
// procs.go: a P more than the CPUs for each ring watched), so that the
// runner tests serve as the daemon's rings do.
func reserveTestProcs(n int) {
	if p := testCPUs + n; p > runtime.GOMAXPROCS(0) {
		runtime.GOMAXPROCS(p)
	}
}

var testCPUs = runtime.GOMAXPROCS(0)

// TestRingsWatched: a back end tells Config.RingsWatched of the rings that
// may have a watcher once for each larger count, before the ring is
// served: rings 0-2 started, 1, 2 and 3. Nothing for a back end whose
// rings did not start (each P costs memory), nothing when a ring stops or
// restarts (a change of GOMAXPROCS there stops the world on the message
// loop), and the package itself leaves GOMAXPROCS alone.
func TestRingsWatched(t *testing.T) {
	var mu sync.Mutex
	var told []int
	record := func(n int) {
		mu.Lock()
		defer mu.Unlock()
		told = append(told, n)
	}
	seen := func() []int {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(told)
	}
	before := runtime.GOMAXPROCS(0)
	if _, err := NewBackend(Config{Handler: HandlerFunc(func(int) RequestHandler { return echoHandler{} }),
		RequestQueues: MaxRings - 1, RingsWatched: record}); err != nil {
		t.Fatal(err)
	}
	if got := seen(); len(got) != 0 {
		t.Errorf("a back end with %d rings, none started: told %v, want nothing", MaxRings, got)
	}
	_, d := startProbeWatched(t, 2, 1, record)
	want := []int{1, 2, 3}
	for range 3 {
		at, err := d.StopQueue(2)
		if err != nil {
			t.Fatal(err)
		}
		// Answered after every message before it.
		if got := seen(); !slices.Equal(got, want) {
			t.Fatalf("rings 0-2 started, ring 2 stopped: told %v, want %v", got, want)
		}
		if err := d.RestartQueue(2, at, false); err != nil {
			t.Fatal(err)
		}
		at1, err := d.StopQueue(1) // answered after the restart
		if err != nil {
			t.Fatal(err)
		}
		if err := d.RestartQueue(1, at1, false); err != nil {
			t.Fatal(err)
		}
		if got := seen(); !slices.Equal(got, want) {
			t.Fatalf("ring 2 restarted: told %v, want %v", got, want)
		}
	}
	if got := runtime.GOMAXPROCS(0); got != before {
		t.Errorf("GOMAXPROCS %d, was %d: the back end changed it", got, before)
	}
}
