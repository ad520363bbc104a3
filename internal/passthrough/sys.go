package passthrough

import (
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// Raw *at wrappers. They take NUL-terminated names built in stack buffers
// (cname, fdName) so that no request path converts Go strings, which would
// allocate. Every call retries on EINTR.

const nameMax = 255 // NAME_MAX

// cname holds one validated path component, NUL-terminated.
type cname [nameMax + 1]byte

// set copies name (already validated: 1..255 bytes, no '/', no NUL) and
// returns a pointer to the C string.
func (c *cname) set(name []byte) *byte {
	n := copy(c[:nameMax], name)
	c[n] = 0
	return &c[0]
}

// setString is set for a name the daemon recorded (already validated).
func (c *cname) setString(name string) *byte {
	n := copy(c[:nameMax], name)
	c[n] = 0
	return &c[0]
}

// fdName is the decimal name of an fd inside /proc/self/fd.
type fdName [24]byte

func (b *fdName) set(fd int) *byte {
	i := len(b) - 1
	b[i] = 0
	u := uint64(fd)
	for {
		i--
		b[i] = byte('0' + u%10)
		u /= 10
		if u == 0 {
			break
		}
	}
	return &b[i]
}

// emptyPath is "" for AT_EMPTY_PATH calls.
var emptyPath = [1]byte{0}

var dotPath = [2]byte{'.', 0}
var dotdotPath = [3]byte{'.', '.', 0}

func sysOpenat(dirfd int, path *byte, flags int, mode uint32) (int, syscall.Errno) {
	for {
		r, _, e := unix.Syscall6(unix.SYS_OPENAT, uintptr(dirfd), uintptr(unsafe.Pointer(path)),
			uintptr(flags), uintptr(mode), 0, 0)
		if e == unix.EINTR {
			continue
		}
		if e != 0 {
			return -1, e
		}
		return int(r), 0
	}
}

func sysOpenat2(dirfd int, path *byte, how *unix.OpenHow) (int, syscall.Errno) {
	for {
		r, _, e := unix.Syscall6(unix.SYS_OPENAT2, uintptr(dirfd), uintptr(unsafe.Pointer(path)),
			uintptr(unsafe.Pointer(how)), unsafe.Sizeof(*how), 0, 0)
		if e == unix.EINTR {
			continue
		}
		if e != 0 {
			return -1, e
		}
		return int(r), 0
	}
}

func sysStatx(dirfd int, path *byte, flags int, mask uint32, st *unix.Statx_t) syscall.Errno {
	for {
		_, _, e := unix.Syscall6(unix.SYS_STATX, uintptr(dirfd), uintptr(unsafe.Pointer(path)),
			uintptr(flags), uintptr(mask), uintptr(unsafe.Pointer(st)), 0)
		if e != unix.EINTR {
			return e
		}
	}
}

func sysFstat(fd int, st *syscall.Stat_t) syscall.Errno {
	for {
		_, _, e := unix.Syscall(unix.SYS_FSTAT, uintptr(fd), uintptr(unsafe.Pointer(st)), 0)
		if e != unix.EINTR {
			return e
		}
	}
}

func sysMkdirat(dirfd int, path *byte, mode uint32) syscall.Errno {
	_, _, e := unix.Syscall(unix.SYS_MKDIRAT, uintptr(dirfd), uintptr(unsafe.Pointer(path)), uintptr(mode))
	return e
}

func sysMknodat(dirfd int, path *byte, mode uint32, dev uint64) syscall.Errno {
	_, _, e := unix.Syscall6(unix.SYS_MKNODAT, uintptr(dirfd), uintptr(unsafe.Pointer(path)),
		uintptr(mode), uintptr(dev), 0, 0)
	return e
}

func sysSymlinkat(target *byte, dirfd int, path *byte) syscall.Errno {
	_, _, e := unix.Syscall(unix.SYS_SYMLINKAT, uintptr(unsafe.Pointer(target)), uintptr(dirfd),
		uintptr(unsafe.Pointer(path)))
	return e
}

func sysUnlinkat(dirfd int, path *byte, flags int) syscall.Errno {
	_, _, e := unix.Syscall(unix.SYS_UNLINKAT, uintptr(dirfd), uintptr(unsafe.Pointer(path)), uintptr(flags))
	return e
}

func sysRenameat2(olddirfd int, oldpath *byte, newdirfd int, newpath *byte, flags uint32) syscall.Errno {
	_, _, e := unix.Syscall6(unix.SYS_RENAMEAT2, uintptr(olddirfd), uintptr(unsafe.Pointer(oldpath)),
		uintptr(newdirfd), uintptr(unsafe.Pointer(newpath)), uintptr(flags), 0)
	return e
}

func sysLinkat(olddirfd int, oldpath *byte, newdirfd int, newpath *byte, flags int) syscall.Errno {
	_, _, e := unix.Syscall6(unix.SYS_LINKAT, uintptr(olddirfd), uintptr(unsafe.Pointer(oldpath)),
		uintptr(newdirfd), uintptr(unsafe.Pointer(newpath)), uintptr(flags), 0)
	return e
}

func sysFchmodat(dirfd int, path *byte, mode uint32) syscall.Errno {
	for {
		_, _, e := unix.Syscall(unix.SYS_FCHMODAT, uintptr(dirfd), uintptr(unsafe.Pointer(path)), uintptr(mode))
		if e != unix.EINTR {
			return e
		}
	}
}

func sysFchmod(fd int, mode uint32) syscall.Errno {
	for {
		_, _, e := unix.Syscall(unix.SYS_FCHMOD, uintptr(fd), uintptr(mode), 0)
		if e != unix.EINTR {
			return e
		}
	}
}

func sysFchownat(dirfd int, path *byte, uid, gid int, flags int) syscall.Errno {
	_, _, e := unix.Syscall6(unix.SYS_FCHOWNAT, uintptr(dirfd), uintptr(unsafe.Pointer(path)),
		uintptr(uid), uintptr(gid), uintptr(flags), 0)
	return e
}

// sysUtimensat with a nil path is futimens(dirfd).
func sysUtimensat(dirfd int, path *byte, ts *[2]unix.Timespec, flags int) syscall.Errno {
	_, _, e := unix.Syscall6(unix.SYS_UTIMENSAT, uintptr(dirfd), uintptr(unsafe.Pointer(path)),
		uintptr(unsafe.Pointer(ts)), uintptr(flags), 0, 0)
	return e
}

func sysReadlinkat(dirfd int, path *byte, buf []byte) (int, syscall.Errno) {
	var p unsafe.Pointer
	if len(buf) > 0 {
		p = unsafe.Pointer(&buf[0])
	} else {
		p = unsafe.Pointer(&emptyPath[0])
	}
	r, _, e := unix.Syscall6(unix.SYS_READLINKAT, uintptr(dirfd), uintptr(unsafe.Pointer(path)),
		uintptr(p), uintptr(len(buf)), 0, 0)
	if e != 0 {
		return 0, e
	}
	return int(r), 0
}

func sysFtruncate(fd int, size int64) syscall.Errno {
	for {
		_, _, e := unix.Syscall(unix.SYS_FTRUNCATE, uintptr(fd), uintptr(size), 0)
		if e != unix.EINTR {
			return e
		}
	}
}

func sysClose(fd int) {
	if fd >= 0 {
		unix.Syscall(unix.SYS_CLOSE, uintptr(fd), 0, 0)
	}
}

func sysGetdents(fd int, buf []byte) (int, syscall.Errno) {
	for {
		r, _, e := unix.Syscall(unix.SYS_GETDENTS64, uintptr(fd), uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf)))
		if e == unix.EINTR {
			continue
		}
		if e != 0 {
			return 0, e
		}
		return int(r), 0
	}
}

func sysLseek(fd int, off int64, whence int) (int64, syscall.Errno) {
	r, _, e := unix.Syscall(unix.SYS_LSEEK, uintptr(fd), uintptr(off), uintptr(whence))
	if e != 0 {
		return 0, e
	}
	return int64(r), 0
}

// xattr calls; path variants resolve relative to the calling thread's cwd.

func bufPtr(b []byte) unsafe.Pointer {
	if len(b) == 0 {
		return nil
	}
	return unsafe.Pointer(&b[0])
}

func sysFgetxattr(fd int, name *byte, dst []byte) (int, syscall.Errno) {
	r, _, e := unix.Syscall6(unix.SYS_FGETXATTR, uintptr(fd), uintptr(unsafe.Pointer(name)),
		uintptr(bufPtr(dst)), uintptr(len(dst)), 0, 0)
	if e != 0 {
		return 0, e
	}
	return int(r), 0
}

func sysGetxattr(path *byte, name *byte, dst []byte) (int, syscall.Errno) {
	r, _, e := unix.Syscall6(unix.SYS_GETXATTR, uintptr(unsafe.Pointer(path)), uintptr(unsafe.Pointer(name)),
		uintptr(bufPtr(dst)), uintptr(len(dst)), 0, 0)
	if e != 0 {
		return 0, e
	}
	return int(r), 0
}

func sysFsetxattr(fd int, name *byte, val []byte, flags int) syscall.Errno {
	_, _, e := unix.Syscall6(unix.SYS_FSETXATTR, uintptr(fd), uintptr(unsafe.Pointer(name)),
		uintptr(bufPtr(val)), uintptr(len(val)), uintptr(flags), 0)
	return e
}

func sysSetxattr(path *byte, name *byte, val []byte, flags int) syscall.Errno {
	_, _, e := unix.Syscall6(unix.SYS_SETXATTR, uintptr(unsafe.Pointer(path)), uintptr(unsafe.Pointer(name)),
		uintptr(bufPtr(val)), uintptr(len(val)), uintptr(flags), 0)
	return e
}

func sysFlistxattr(fd int, dst []byte) (int, syscall.Errno) {
	r, _, e := unix.Syscall(unix.SYS_FLISTXATTR, uintptr(fd), uintptr(bufPtr(dst)), uintptr(len(dst)))
	if e != 0 {
		return 0, e
	}
	return int(r), 0
}

func sysListxattr(path *byte, dst []byte) (int, syscall.Errno) {
	r, _, e := unix.Syscall(unix.SYS_LISTXATTR, uintptr(unsafe.Pointer(path)), uintptr(bufPtr(dst)), uintptr(len(dst)))
	if e != 0 {
		return 0, e
	}
	return int(r), 0
}

func sysFremovexattr(fd int, name *byte) syscall.Errno {
	_, _, e := unix.Syscall(unix.SYS_FREMOVEXATTR, uintptr(fd), uintptr(unsafe.Pointer(name)), 0)
	return e
}

func sysRemovexattr(path *byte, name *byte) syscall.Errno {
	_, _, e := unix.Syscall(unix.SYS_REMOVEXATTR, uintptr(unsafe.Pointer(path)), uintptr(unsafe.Pointer(name)), 0)
	return e
}

// toErrno converts an error from x/sys or bufvec to an errno for the guest.
func toErrno(err error) syscall.Errno {
	if err == nil {
		return 0
	}
	if e, ok := err.(syscall.Errno); ok {
		return e
	}
	return syscall.EIO
}

// fileWait says how the I/O of open file fd is to be issued: raw
// (bufvec.Bounded) on file systems whose I/O completes on this machine
// (statfs f_type, linux/magic.h); told to the scheduler (bufvec.MayWait)
// on anything else (NFS, CIFS, FUSE, Ceph, 9p, and whatever is not listed),
// which may wait on a peer for any time. ok is false when fstatfs failed
// (the answer is then MayWait, the safe one).
func fileWait(fd int) (w bufvec.Wait, ok bool) {
	var st unix.Statfs_t
	if err := unix.Fstatfs(fd, &st); err != nil {
		return bufvec.MayWait, false
	}
	switch uint32(st.Type) {
	case unix.TMPFS_MAGIC, unix.RAMFS_MAGIC, unix.EXT4_SUPER_MAGIC, unix.XFS_SUPER_MAGIC,
		unix.BTRFS_SUPER_MAGIC, unix.F2FS_SUPER_MAGIC,
		unix.OVERLAYFS_SUPER_MAGIC: // over local layers, as container images are
		return bufvec.Bounded, true
	}
	return bufvec.MayWait, true
}
