package passthrough

import (
	"math"
	"syscall"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// copyChunk is the most one host copy_file_range is asked for: where the
// host file system has no copy_file_range of its own (ext4, tmpfs), the
// kernel copies through splice, at most MAX_RW_COUNT (2 GiB - 4 KiB) per
// call, whatever was asked.
const copyChunk = math.MaxInt32 &^ 4095

// CopyFileRange copies min(in.Len, limit) bytes between two file handles
// (COPY_FILE_RANGE, COPY_FILE_RANGE_64) with the host's copy_file_range,
// and returns how many it copied.
//
// The whole length is served in one request, in calls of copyChunk, up to
// the source's end: a short copy is legal, but a guest that asked for
// 5 GiB in one COPY_FILE_RANGE_64 would then come back three times, and
// one call that copies it all is what the opcode is for. A failure after
// some bytes were copied answers those bytes, as copy_file_range does.
//
// Holes stay holes: where the host would copy through splice, it reads a
// hole of the source as zeros and writes them, so that a sparse 5 GiB file
// costs 5 GiB of the destination's storage. Between two different files,
// the source's holes (SEEK_DATA, SEEK_HOLE) are not copied but punched in
// the destination where it has data (FALLOC_FL_PUNCH_HOLE, else copied
// after all) and the destination is extended over a hole the copy ends
// with, so the destination reads as the copy would have left it.
func (f *FS) CopyFileRange(in *gofuse.CopyFileRangeIn, limit uint64) (uint64, syscall.Errno) {
	if f.opts.ReadOnly {
		return 0, syscall.EROFS
	}
	hin, errno := f.fileHandle(in.FhIn, in.NodeId)
	if errno != 0 {
		return 0, errno
	}
	defer hin.put()
	hout, errno := f.fileHandle(in.FhOut, in.NodeIdOut)
	if errno != 0 {
		return 0, errno
	}
	defer hout.put()
	offIn, offOut := int64(in.OffIn), int64(in.OffOut)
	if offIn < 0 || offOut < 0 || in.Flags != 0 {
		return 0, syscall.EINVAL // copy_file_range(2) takes no flags
	}
	n := min(in.Len, limit, uint64(math.MaxInt64-max(offIn, offOut)))
	if f.dax.on.Load() {
		// The source's guest stores reach its file first (before the
		// destination's lock: one tails lock at a time); the bytes
		// copied reach the destination's tails.
		if hin.ino != hout.ino {
			hin.ino.writeBackTails(hin.ino.tails.Load(), false)
		}
		nt := hout.ino.lockTails()
		if hin.ino == hout.ino {
			hin.ino.writeBackTails(nt, true)
		}
		done, errno := copyRange(hin.fd, offIn, hout.fd, offOut, int64(n))
		hout.ino.tailsChanged(nt, uint64(offOut), done)
		return done, errno
	}
	return copyRange(hin.fd, offIn, hout.fd, offOut, int64(n))
}

// copyRange copies n bytes from in at offIn to out at offOut (see
// CopyFileRange).
func copyRange(in int, offIn int64, out int, offOut int64, n int64) (uint64, syscall.Errno) {
	// A copy of nothing makes the kernel check the two files (read and
	// write access, O_APPEND, overlapping ranges of one file) before
	// anything is punched.
	if _, err := unix.CopyFileRange(in, &offIn, out, &offOut, 0, 0); err != nil {
		return 0, toErrno(err)
	}
	if n == 0 {
		return 0, 0
	}
	sparse := sparseCopy(in, out)
	var done int64
	for done < n {
		pos, end := offIn+done, offIn+n
		if sparse {
			hole, segEnd, ok := nextSegment(in, pos, end)
			switch {
			case !ok:
				sparse = false
				continue
			case segEnd <= pos:
				n = done // the source ends here
				continue
			case hole:
				if punchHole(out, offOut+done, segEnd-pos) {
					done += segEnd - pos
					continue
				}
			}
			end = segEnd
		}
		p, q := pos, offOut+done
		got, err := unix.CopyFileRange(in, &p, out, &q, int(min(end-pos, copyChunk)), 0)
		if err != nil {
			if done > 0 {
				break
			}
			return 0, toErrno(err)
		}
		if got == 0 {
			break // the source's end
		}
		done += int64(got)
	}
	if sparse && done > 0 {
		// The copy ended with a hole: the destination reaches its end.
		var st syscall.Stat_t
		if sysFstat(out, &st) == 0 && st.Size < offOut+done {
			if err := unix.Ftruncate(out, offOut+done); err != nil {
				return 0, toErrno(err)
			}
		}
	}
	return uint64(done), 0
}

// sparseCopy reports whether holes may be skipped: two different regular
// files (one file's ranges may not overlap, and punching in it is not
// worth the care).
func sparseCopy(in, out int) bool {
	var a, b syscall.Stat_t
	if sysFstat(in, &a) != 0 || sysFstat(out, &b) != 0 {
		return false
	}
	return a.Mode&syscall.S_IFMT == syscall.S_IFREG && b.Mode&syscall.S_IFMT == syscall.S_IFREG &&
		(a.Dev != b.Dev || a.Ino != b.Ino)
}

// nextSegment finds what of in starts at pos: data up to segEnd, or a hole
// up to segEnd (hole), segEnd at most end; segEnd <= pos when pos is at or
// past the source's end. ok is false when in cannot say (no SEEK_DATA).
func nextSegment(in int, pos, end int64) (hole bool, segEnd int64, ok bool) {
	data, e := sysLseek(in, pos, unix.SEEK_DATA)
	switch {
	case e == syscall.ENXIO:
		// Nothing but hole from pos to the end of the file.
		var st syscall.Stat_t
		if sysFstat(in, &st) != 0 {
			return false, 0, false
		}
		return true, min(end, st.Size), true
	case e != 0:
		return false, 0, false
	case data > pos:
		return true, min(end, data), true
	}
	h, e := sysLseek(in, pos, unix.SEEK_HOLE)
	if e != 0 {
		return false, 0, false
	}
	return false, min(end, h), true
}

// punchHole makes out read as zeros for n bytes at off: nothing to do past
// its end, a punched hole before it. False when it cannot punch.
func punchHole(out int, off, n int64) bool {
	var st syscall.Stat_t
	if sysFstat(out, &st) != 0 {
		return false
	}
	if off >= st.Size {
		return true
	}
	n = min(n, st.Size-off)
	return unix.Fallocate(out, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n) == nil
}
