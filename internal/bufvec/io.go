package bufvec

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// iovMax is the kernel's UIO_MAXIOV: the most iovecs one vectored call takes.
const iovMax = 1024

// iovecs is scratch space for building iovec arrays without allocating.
type iovecs struct {
	v []unix.Iovec
}

func (s *iovecs) init(maxSegs int) {
	s.v = make([]unix.Iovec, 0, min(max(maxSegs, 1), iovMax))
}

// fill builds iovecs for up to n bytes starting at the cursor, stopping at
// iovMax entries or at the first unmapped segment. It returns the number of
// bytes covered.
func (v *Vec) fill(n int) int {
	if cap(v.iov.v) == 0 {
		v.iov.init(len(v.segs))
	}
	iov := v.iov.v[:0]
	covered := 0
	off := v.off
	for i := v.seg; i < len(v.segs) && covered < n && len(iov) < cap(iov); i++ {
		s := &v.segs[i]
		if !s.Mapped() {
			break
		}
		c := min(len(s.Buf)-off, n-covered)
		iov = append(iov, unix.Iovec{Base: &s.Buf[off], Len: uint64(c)})
		covered += c
		off = 0
	}
	v.iov.v = iov
	return covered
}

// Wait says whether a host file's I/O may wait on something other than
// this machine's CPUs and memory, which decides how WriteTo and ReadFrom
// issue their syscalls.
type Wait bool

const (
	// MayWait: a network, FUSE or unknown file system, whose I/O can wait
	// on a peer for any time. Its syscalls tell the Go scheduler, which
	// hands the thread's P to another thread while they run, so one stuck
	// call cannot hold up other requests or a garbage collection.
	MayWait Wait = true
	// Bounded: a local file system (tmpfs, ext4, xfs, btrfs...), whose
	// I/O completes on this machine. Its syscalls are issued raw: for a
	// call of a few hundred microseconds the hand-off above costs two
	// context switches and keeps the scheduler's monitor polling every
	// 20 µs, as much CPU as a quarter of the copy itself.
	Bounded Wait = false
)

// WriteTo writes the next n bytes after the cursor to fd at file offset off
// with pwritev straight from guest memory, looping on short writes and
// splitting at IOV_MAX, and advances the cursor by what was written.
// Unmapped segments go through the Bouncer; without one it stops early,
// with ErrUnmapped, at the first, the bytes before it written and counted.
func (v *Vec) WriteTo(fd int, off int64, n int, wait Wait) (int, error) {
	return v.transfer(fd, off, n, wait, false)
}

// ReadFrom reads up to n bytes from fd at file offset off into the segments
// after the cursor with preadv, looping on short reads until n bytes or end
// of file, and advances the cursor by what was read. Unmapped segments are
// handled as by WriteTo.
func (v *Vec) ReadFrom(fd int, off int64, n int, wait Wait) (int, error) {
	return v.transfer(fd, off, n, wait, true)
}

// transfer is ReadFrom (toGuest) or WriteTo: it moves the next n bytes
// after the cursor, a run of mapped segments at a time with one vectored
// call or a run of unmapped ones through the Bouncer, until all are moved
// or a step moves nothing: the end of the file for a read, EIO for a write
// to the file (one never takes 0 bytes of n > 0), and for a bounce
// whatever the VMM answered.
func (v *Vec) transfer(fd int, off int64, n int, wait Wait, toGuest bool) (int, error) {
	if n < 0 || n > v.Len() {
		return 0, ErrShort
	}
	trap := uintptr(unix.SYS_PWRITEV)
	if toGuest {
		trap = unix.SYS_PREADV
	}
	done := 0
	for done < n {
		var k int
		var err error
		covered := v.fill(n - done)
		if covered == 0 {
			k, err = v.bounce(fd, off+int64(done), n-done, toGuest) // advances the cursor
		} else {
			k, err = vectored(trap, fd, v.iov.v, off+int64(done), wait)
			if k > 0 {
				v.advance(k)
			}
		}
		done += k
		if err != nil {
			return done, err
		}
		if k == 0 {
			if covered > 0 && !toGuest {
				return done, unix.EIO
			}
			break
		}
	}
	return done, nil
}

// Bouncer moves data between a host file and guest memory the daemon
// cannot map, by asking the VMM to do it (the FS_IO back-end request).
type Bouncer interface {
	// Bounce transfers the segments' bytes to (toGuest) or from the file
	// at off and returns the bytes done; reads stop early at end of file.
	Bounce(fd int, off int64, segs []Segment, toGuest bool) (int, error)
}

// SetBouncer lets WriteTo and ReadFrom move unmapped segments through b
// (nil: they stop there with ErrUnmapped).
func (v *Vec) SetBouncer(b Bouncer) { v.bouncer = b }

// maxBounceSegs is how many unmapped segments go to the Bouncer per call.
const maxBounceSegs = 8

// bounce transfers the run of unmapped segments at the cursor (at most n
// bytes) through the Bouncer and advances the cursor by what was done.
func (v *Vec) bounce(fd int, off int64, n int, toGuest bool) (int, error) {
	if v.bouncer == nil {
		return 0, ErrUnmapped
	}
	var run [maxBounceSegs]Segment
	cnt, size := 0, 0
	for i, skip := v.seg, v.off; i < len(v.segs) && cnt < len(run) && size < n; i++ {
		s := v.segs[i]
		if s.Mapped() {
			break
		}
		l := min(int(s.Len)-skip, n-size)
		run[cnt] = Segment{GPA: s.GPA + uint64(skip), Len: uint32(l)}
		cnt++
		size += l
		skip = 0
	}
	done, err := v.bouncer.Bounce(fd, off, run[:cnt], toGuest)
	if done > 0 {
		v.advance(done)
	}
	return done, err
}

// vectored issues one preadv/pwritev, retrying on EINTR. It uses the raw
// syscall interface so the hot path allocates nothing.
func vectored(trap uintptr, fd int, iov []unix.Iovec, off int64, wait Wait) (int, error) {
	if len(iov) == 0 {
		return 0, nil
	}
	for {
		a1, a2, a3 := uintptr(fd), uintptr(unsafe.Pointer(&iov[0])), uintptr(len(iov))
		a4, a5 := uintptr(off), uintptr(uint64(off)>>32>>32)
		var r uintptr
		var errno unix.Errno
		if wait == MayWait {
			r, _, errno = unix.Syscall6(trap, a1, a2, a3, a4, a5, 0)
		} else {
			r, _, errno = unix.RawSyscall6(trap, a1, a2, a3, a4, a5, 0)
		}
		if errno == unix.EINTR {
			continue
		}
		if errno != 0 {
			return 0, errno
		}
		return int(r), nil
	}
}
