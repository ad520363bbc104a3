package vhostuser

import (
	"fmt"
	"runtime"
	"sync"

	"golang.org/x/sys/unix"
)

// kickWatch is how a runner sleeps until the guest kicks its ring. The
// watching server sleeps in ppoll(2) on the thread it runs on, as the C
// daemon's queue thread does, so a kick wakes that thread and nothing else.
// Through Go's netpoller a kick wakes the poller's thread, which then runs
// the scheduler to find and resume the server: on a guest doing 4 KiB
// requests one at a time, that extra work is CPU taken from its vCPUs.
//
// A thread asleep in a system call still holds its P (GOMAXPROCS slot).
// With no idle P left, sysmon takes it away after 20 us and hands it to a
// fresh thread, and the sleeper must win a P back when it wakes: on the
// metadata cycle that was 61k context switches a second against 13k. So
// GOMAXPROCS has one P more than the CPUs for every ring started
// (reserveWatchers), and the Ps the CPUs stand for stay free for the
// servers that work.
type kickWatch struct {
	kick int // our dup of the front end's kick eventfd
	stop int // an eventfd of our own; written once, to end every wait
	fds  [2]unix.PollFd
}

// newKickWatch watches a dup of kickFD, so closing it cannot race with the
// message loop replacing the ring's kick fd.
func newKickWatch(kickFD int) (*kickWatch, error) {
	kick, err := unix.FcntlInt(uintptr(kickFD), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("dup kick fd: %w", err)
	}
	// The front end's eventfds are non-blocking already (QEMU's are);
	// a read must never block where ppoll saw a kick another reader took.
	if err := unix.SetNonblock(kick, true); err != nil {
		unix.Close(kick)
		return nil, fmt.Errorf("kick fd: %w", err)
	}
	stop, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		unix.Close(kick)
		return nil, fmt.Errorf("stop eventfd: %w", err)
	}
	return &kickWatch{kick: kick, stop: stop}, nil
}

// wait sleeps until the ring is kicked or interrupt is called, and consumes
// the kick. Spurious returns are fine: the caller looks at the ring again.
func (k *kickWatch) wait() error {
	k.fds = [2]unix.PollFd{{Fd: int32(k.kick), Events: unix.POLLIN}, {Fd: int32(k.stop), Events: unix.POLLIN}}
	if _, err := unix.Ppoll(k.fds[:], nil, nil); err != nil && err != unix.EINTR {
		return fmt.Errorf("poll kick fd: %w", err)
	}
	if k.fds[0].Revents&(unix.POLLERR|unix.POLLNVAL) != 0 {
		return fmt.Errorf("poll kick fd: revents %#x", k.fds[0].Revents)
	}
	if k.fds[0].Revents&unix.POLLIN != 0 {
		var buf [8]byte
		if _, err := unix.Read(k.kick, buf[:]); err != nil && err != unix.EAGAIN {
			return fmt.Errorf("read kick fd: %w", err)
		}
	}
	return nil
}

// interrupt ends the current wait and every later one.
func (k *kickWatch) interrupt() {
	one := [8]byte{1}
	unix.Write(k.stop, one[:]) // cannot fail short of overflow, and it is never read
}

func (k *kickWatch) close() {
	unix.Close(k.kick)
	unix.Close(k.stop)
}

// watchers is the process's reservation of Ps for kick watchers, across
// back ends.
var watchers struct {
	sync.Mutex
	base     int // GOMAXPROCS before the first reservation: the CPUs
	reserved int // Ps added: the most rings any back end may watch
}

// reserveWatchers makes room for n watchers: rings 0 to n-1. It is called
// when a ring is first started (vring.start), never when one stops, and
// the Ps only grow, to the most rings any back end of the process started:
// changing GOMAXPROCS stops the world, and a world stop on the message loop
// after a stopped ring's servers exited had not completed after 10 s, twice
// in about 56,000 connections of the bench's front end (GET_VRING_BASE
// unanswered, Go 1.26), when every start and stop changed it. QEMU sets up
// every ring before it enables the first, so the few changes left come
// before any server runs. Not reserved up front for every ring a back end
// may have: each P has its own allocation caches and garbage collector
// worker, and the default 255 request queues took the idle daemon from 3
// to 10 MiB of anonymous memory.
func reserveWatchers(n int) {
	watchers.Lock()
	defer watchers.Unlock()
	if watchers.reserved == 0 {
		watchers.base = runtime.GOMAXPROCS(0)
	}
	if n > watchers.reserved {
		watchers.reserved = n
		runtime.GOMAXPROCS(watchers.base + n)
	}
}

// procsWithoutWatchers is GOMAXPROCS less what the watchers added: the CPUs
// the servers have (DefaultWorkers).
func procsWithoutWatchers() int {
	watchers.Lock()
	defer watchers.Unlock()
	if watchers.reserved > 0 {
		return watchers.base
	}
	return runtime.GOMAXPROCS(0)
}
