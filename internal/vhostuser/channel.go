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
	c.ioMu.Lock()
	defer c.ioMu.Unlock()
	if c.aborting.Load() > 0 {
		return 0, errCancelled
	}
	f := c.file()
	if f == nil {
		return 0, unix.EFAULT
	}
	if err := c.discardStale(f); err != nil {
		return 0, err
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
	if err := sendRequest(f, backendReqFSIO, p[:], fd); err != nil {
		return 0, fmt.Errorf("send FS_IO: %w", err)
	}
	got, err := readAck(f, backendReqFSIO)
	if err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			c.stale++ // the VMM may still answer (and may still do the I/O)
			return 0, errCancelled
		}
		return 0, unix.EIO
	}
	if got != total {
		return 0, unix.EFAULT
	}
	return int(total), nil
}

// discardStale reads the late replies of cancelled requests.
func (c *BackendChannel) discardStale(f *os.File) error {
	f.SetReadDeadline(time.Time{})
	for c.stale > 0 {
		f.SetReadDeadline(time.Now().Add(staleReplyWait))
		_, err := readAck(f, backendReqFSIO)
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

// sendRequest sends a back-end request with NEED_REPLY and one fd.
func sendRequest(f *os.File, req uint32, payload []byte, fd int) error {
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
		serr = unix.Sendmsg(int(s), msg, unix.UnixRights(fd), nil, 0)
		return serr != unix.EAGAIN
	})
	if werr != nil {
		return werr
	}
	return serr
}

// readAck reads a u64 reply to request req.
func readAck(f *os.File, req uint32) (uint64, error) {
	var b [headerSize + 8]byte
	if _, err := io.ReadFull(f, b[:]); err != nil {
		return 0, err
	}
	if r := binary.LittleEndian.Uint32(b[0:]); r != req {
		return 0, fmt.Errorf("reply to request %d, want %d", r, req)
	}
	if fl := binary.LittleEndian.Uint32(b[4:]); fl&flagReply == 0 {
		return 0, fmt.Errorf("reply without the reply flag (%#x)", fl)
	}
	if n := binary.LittleEndian.Uint32(b[8:]); n != 8 {
		return 0, fmt.Errorf("reply payload of %d bytes", n)
	}
	return binary.LittleEndian.Uint64(b[headerSize:]), nil
}
