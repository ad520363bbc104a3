package vhostuser

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// kickWatch is how a runner sleeps until the guest kicks its ring. The
// watching server sleeps in ppoll(2) on the thread it runs on, as the C
// daemon's queue thread does, so a kick wakes that thread and nothing else
// (through Go's netpoller it would wake the poller's thread, which then
// runs the scheduler to find the server). The sleeping thread holds its P:
// Config.RingsWatched lets the daemon add one per ring (doc.go, Rationale).
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
