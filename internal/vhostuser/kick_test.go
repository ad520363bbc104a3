package vhostuser

import (
	"runtime"
	"strings"
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

// TestWatchersReserveProcs: a back end reserves a P for every ring it may
// watch when it is made, GOMAXPROCS never shrinks or changes again for a
// back end that needs no more, and Config.CPUs still counts the CPUs alone.
// Starting and stopping rings must not change it: that stops the world on
// the message loop (reserveWatchers).
func TestWatchersReserveProcs(t *testing.T) {
	base := procsWithoutWatchers()
	want := base + max(watchers.reserved, 3)
	newTestBackend(t, "") // 2 request queues
	if got := runtime.GOMAXPROCS(0); got != want {
		t.Errorf("back end with 3 rings: GOMAXPROCS %d, want %d", got, want)
	}
	if _, err := NewBackend(Config{Handler: HandlerFunc(func(int) RequestHandler { return echoHandler{} }), RequestQueues: 1}); err != nil {
		t.Fatal(err)
	}
	if got := runtime.GOMAXPROCS(0); got != want {
		t.Errorf("then one with 2 rings: GOMAXPROCS %d, want %d", got, want)
	}
	long := strings.Repeat("t", 37)
	if _, err := NewBackend(Config{Handler: HandlerFunc(func(int) RequestHandler { return echoHandler{} }), RequestQueues: 8, Tag: long}); err == nil {
		t.Fatal("a 37-byte tag was accepted")
	}
	if got := runtime.GOMAXPROCS(0); got != want {
		t.Errorf("after a refused back end with 9 rings: GOMAXPROCS %d, want %d", got, want)
	}
	if got := procsWithoutWatchers(); got != base {
		t.Errorf("CPUs with watchers: %d, want %d", got, base)
	}
	_, d := startProbeRings(t, 2, 1, 2) // rings 0-2 started: three watchers
	want = runtime.GOMAXPROCS(0)
	for range 3 {
		at, err := d.StopQueue(2)
		if err != nil {
			t.Fatal(err)
		}
		if got := runtime.GOMAXPROCS(0); got != want {
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
