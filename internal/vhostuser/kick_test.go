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

// TestWatchersAddProcs: each watcher adds one to GOMAXPROCS while it
// lives, and Config.CPUs still counts the CPUs alone.
func TestWatchersAddProcs(t *testing.T) {
	base := runtime.GOMAXPROCS(0)
	addWatcher(1)
	addWatcher(1)
	if got := runtime.GOMAXPROCS(0); got != base+2 {
		t.Errorf("two watchers: GOMAXPROCS %d, want %d", got, base+2)
	}
	if got := procsWithoutWatchers(); got != base {
		t.Errorf("CPUs with watchers: %d, want %d", got, base)
	}
	addWatcher(-1)
	addWatcher(-1)
	if got := runtime.GOMAXPROCS(0); got != base {
		t.Errorf("no watchers: GOMAXPROCS %d, want %d", got, base)
	}
}
