package vhostuser

import (
	"runtime"
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

// TestWatchersReserveProcs: a P is reserved for every ring started, not for
// every ring a back end may have (each P costs memory); GOMAXPROCS never
// shrinks, and DefaultWorkers still counts the CPUs alone. Stopping and
// restarting rings must not change it: that stops the world on the message
// loop (reserveWatchers).
func TestWatchersReserveProcs(t *testing.T) {
	base := procsWithoutWatchers()
	before := runtime.GOMAXPROCS(0)
	if _, err := NewBackend(Config{Handler: HandlerFunc(func(int) RequestHandler { return echoHandler{} }), RequestQueues: MaxRings - 1}); err != nil {
		t.Fatal(err)
	}
	if got := runtime.GOMAXPROCS(0); got != before {
		t.Errorf("a back end with %d rings, none started: GOMAXPROCS %d, want %d", MaxRings, got, before)
	}
	if got := procsWithoutWatchers(); got != base {
		t.Errorf("CPUs with watchers: %d, want %d", got, base)
	}
	_, d := startProbeRings(t, 2, 1)
	var want int
	for i := range 3 {
		at, err := d.StopQueue(2)
		if err != nil {
			t.Fatal(err)
		}
		got := runtime.GOMAXPROCS(0)
		switch {
		case i == 0 && got < base+3:
			// Answered after every message before it: rings 0-2
			// were started, three watchers.
			t.Fatalf("rings 0-2 started: GOMAXPROCS %d, want at least %d", got, base+3)
		case i == 0:
			want = got
		case got != want:
			t.Fatalf("ring 2 stopped: GOMAXPROCS %d, want %d", got, want)
		}
		if err := d.RestartQueue(2, at, false); err != nil {
			t.Fatal(err)
		}
		if got := runtime.GOMAXPROCS(0); got != want {
			t.Fatalf("ring 2 restarted: GOMAXPROCS %d, want %d", got, want)
		}
	}
}
