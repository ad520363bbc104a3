package vhostuser

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// Back-end request ids (back end → front end).
const (
	// backendReqFSIO asks the VMM to move data between a file and guest
	// memory the daemon cannot map. 1003 is the id the rust-vmm vhost crate
	// last used for FS_IO; no released QEMU implements it, so a VMM that
	// does not know it answers with a failure and the request gets EFAULT.
	backendReqFSIO = 1003

	fsioEntries     = 8
	fsioPayloadSize = 4 * 8 * fsioEntries
	fsioMapR        = 1 // file → guest (a READ)
	fsioMapW        = 2 // guest → file (a WRITE)

	// staleReplyWait bounds how long a new FS_IO waits for the late reply
	// to a cancelled one before giving up.
	staleReplyWait = time.Second
)

// errCancelled is the result of an FS_IO request cut short by a ring stop.
var errCancelled = unix.EIO

// BackendChannel is the socket the front end gave us for back-end-initiated
// requests (SET_BACKEND_REQ_FD). It carries the FS_IO bounce: replies have
// no tag, so one request is outstanding at a time across all rings.
//
// A request waiting for the VMM must never hold up GET_VRING_BASE: the
// VMM's main loop, which would answer it, is itself waiting for that
// reply. A ring stop therefore aborts the wait (the request fails with
// EIO, although the VMM may still do the I/O) and the late reply is read
// and discarded before the next request.
type BackendChannel struct {
	fdMu sync.Mutex // guards f
	f    *os.File   // nil: no channel

	ioMu  sync.Mutex // one FS_IO at a time; guards stale
	stale int        // replies still owed to cancelled requests

	usable   atomic.Bool // BACKEND_REQ, BACKEND_SEND_FD and REPLY_ACK negotiated
	aborting atomic.Int32
	// staleWait is staleReplyWait, unless a test shortened it.
	staleWait time.Duration
}

func (c *BackendChannel) set(fd int) {
	var f *os.File
	if fd >= 0 {
		if err := unix.SetNonblock(fd, true); err == nil {
			f = os.NewFile(uintptr(fd), "backend-channel")
		} else {
			unix.Close(fd)
		}
	}
	c.fdMu.Lock()
	old := c.f
	c.f = f
	c.fdMu.Unlock()
	if old != nil {
		old.Close() // wakes a waiting request, which fails
	}
	c.ioMu.Lock()
	c.stale = 0
	c.ioMu.Unlock()
}

func (c *BackendChannel) close() { c.set(-1) }

func (c *BackendChannel) file() *os.File {
	c.fdMu.Lock()
	defer c.fdMu.Unlock()
	return c.f
}

// Available reports whether the front end gave us a channel.
func (c *BackendChannel) Available() bool { return c.file() != nil }

// bounceUsable reports whether FS_IO may be sent.
func (c *BackendChannel) bounceUsable() bool { return c.usable.Load() && c.Available() }

// abort cancels a waiting FS_IO and refuses new ones until endAbort.
func (c *BackendChannel) abort() {
	c.aborting.Add(1)
	if f := c.file(); f != nil {
		f.SetReadDeadline(time.Unix(1, 0))
	}
}

func (c *BackendChannel) endAbort() { c.aborting.Add(-1) }

var _ bufvec.Bouncer = (*BackendChannel)(nil)

// Bounce asks the VMM to move the segments' bytes between file fd at off
// and guest memory (the FS_IO request). It returns the bytes done; a
// failure of the VMM is EFAULT, a cancelled wait EIO.
func (c *BackendChannel) Bounce(fd int, off int64, segs []bufvec.Segment, toGuest bool) (int, error) {
	if len(segs) == 0 {
		return 0, nil
	}
	if len(segs) > fsioEntries {
		segs = segs[:fsioEntries]
	}
	if !c.usable.Load() {
		return 0, unix.EFAULT
	}
	if c.aborting.Load() > 0 {
		return 0, errCancelled
	}
	if !c.Available() {
		return 0, unix.EFAULT
	}
	var total uint64
	var p [fsioPayloadSize]byte
	limit := uint64(1<<63 - 1)
	if toGuest {
		// Clamp a read to end of file: the VMM must report exactly the
		// bytes asked for.
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			return 0, err
		}
		if off >= st.Size {
			return 0, nil
		}
		limit = uint64(st.Size - off)
	}
	flags := uint64(fsioMapW)
	if toGuest {
		flags = fsioMapR
	}
	for i, s := range segs {
		n := min(uint64(s.Len), limit-total)
		if n == 0 {
			break
		}
		binary.LittleEndian.PutUint64(p[8*i:], uint64(off)+total)
		binary.LittleEndian.PutUint64(p[64+8*i:], s.GPA)
		binary.LittleEndian.PutUint64(p[128+8*i:], n)
		binary.LittleEndian.PutUint64(p[192+8*i:], flags)
		total += n
	}
	got, err := c.call(backendReqFSIO, p[:], fd, 0)
	switch {
	case errors.Is(err, errNoChannel):
		return 0, unix.EFAULT
	case errors.Is(err, errUnanswered):
		return 0, errCancelled
	case err != nil:
		return 0, err // EIO: cancelled by a ring stop, or the stream failed
	case got != total:
		return 0, unix.EFAULT
	}
	return int(total), nil
}

// call's errors besides EIO: no channel, and a request sent whose answer
// did not come (a ring stop or the wait's limit): the VMM may still act.
var (
	errNoChannel  = errors.New("no back-end channel")
	errUnanswered = errors.New("back-end request cancelled before its answer")
)

// call sends request req with NEED_REPLY, its payload and fd (none if
// negative), and returns the VMM's u64 answer. One request is outstanding
// at a time: replies carry no tag. It fails with errNoChannel without a
// channel, with errUnanswered when a ring stop cancels the wait for a
// request sent (abort) or the wait outlasts wait (0: no limit), and with
// EIO when the request cannot be sent or the answer is malformed; the reply
// still owed for a request sent and cancelled is read and discarded before
// the next request.
func (c *BackendChannel) call(req uint32, payload []byte, fd int, wait time.Duration) (uint64, error) {
	c.ioMu.Lock()
	defer c.ioMu.Unlock()
	f := c.file()
	if f == nil {
		return 0, errNoChannel
	}
	if err := c.discardStale(f); err != nil {
		return 0, err
	}
	// The deadline first, then the abort check: an abort that comes
	// after the check sets its own deadline after ours (abort), so the
	// wait below cannot miss it.
	var deadline time.Time
	if wait > 0 {
		deadline = time.Now().Add(wait)
	}
	f.SetReadDeadline(deadline)
	if c.aborting.Load() > 0 {
		return 0, errCancelled
	}
	if err := sendRequest(f, req, payload, fd); err != nil {
		return 0, unix.EIO
	}
	got, err := readAck(f, req)
	if err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			c.stale++ // the VMM may still answer (and may still act)
			return 0, errUnanswered
		}
		return 0, unix.EIO
	}
	return got, nil
}

// discardStale reads the late replies of cancelled requests.
func (c *BackendChannel) discardStale(f *os.File) error {
	f.SetReadDeadline(time.Time{})
	wait := c.staleWait
	if wait == 0 {
		wait = staleReplyWait
	}
	for c.stale > 0 {
		f.SetReadDeadline(time.Now().Add(wait))
		_, err := readAck(f, 0)
		f.SetReadDeadline(time.Time{})
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return errCancelled // still owed: do not mix it up with ours
		}
		c.stale--
		if err != nil {
			return unix.EIO
		}
	}
	return nil
}

// sendRequest sends a back-end request with NEED_REPLY and one fd (none if
// fd is negative).
func sendRequest(f *os.File, req uint32, payload []byte, fd int) error {
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	msg := make([]byte, headerSize+len(payload))
	binary.LittleEndian.PutUint32(msg[0:], req)
	binary.LittleEndian.PutUint32(msg[4:], flagVersion|flagNeedReply)
	binary.LittleEndian.PutUint32(msg[8:], uint32(len(payload)))
	copy(msg[headerSize:], payload)
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	werr := rc.Write(func(s uintptr) bool {
		serr = unix.Sendmsg(int(s), msg, oob, nil, 0)
		return serr != unix.EAGAIN
	})
	if werr != nil {
		return werr
	}
	return serr
}

// readAck reads a u64 reply to request req (to any request when req is
// 0). A reply of another size is read whole, so the stream stays in step,
// and refused.
func readAck(f *os.File, req uint32) (uint64, error) {
	var b [headerSize + 8]byte
	if _, err := io.ReadFull(f, b[:headerSize]); err != nil {
		return 0, err
	}
	n := binary.LittleEndian.Uint32(b[8:])
	if n != 8 {
		if n <= maxPayload {
			io.CopyN(io.Discard, f, int64(n))
		}
		return 0, fmt.Errorf("reply payload of %d bytes", n)
	}
	if _, err := io.ReadFull(f, b[headerSize:]); err != nil {
		return 0, err
	}
	if r := binary.LittleEndian.Uint32(b[0:]); req != 0 && r != req {
		return 0, fmt.Errorf("reply to request %d, want %d", r, req)
	}
	if fl := binary.LittleEndian.Uint32(b[4:]); fl&flagReply == 0 {
		return 0, fmt.Errorf("reply without the reply flag (%#x)", fl)
	}
	return binary.LittleEndian.Uint64(b[headerSize:]), nil
}
