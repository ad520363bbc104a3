package passthrough

import (
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// File handle mode (--inode-file-handles=prefer|mandatory): an inode is
// held as a file handle (name_to_handle_at) instead of an O_PATH fd, so the
// guest's lookups do not pin one fd each; each request that needs the object
// opens it with open_by_handle_at (CAP_DAC_READ_SEARCH) on an fd of its
// mount. Handles only ever come from the daemon's own name_to_handle_at,
// never from the guest. An object deleted on the host gives ESTALE.
//
// An inode keeps its handle once, as a string in the kernel's struct
// file_handle layout (handle_bytes, handle_type, f_handle: 8 + 8..40 bytes
// on the usual file systems) in its key: one allocation of its exact size,
// compared as part of the key, and given to open_by_handle_at as it is (the
// kernel only reads it), so that opening an inode by its handle allocates
// nothing.

// maxHandleSize is MAX_HANDLE_SZ, the most f_handle bytes a file system
// may encode.
const maxHandleSize = 128

// handleBuf is a struct file_handle with room for any handle.
type handleBuf struct {
	size uint32 // handle_bytes: room in data on input, the handle's length on output
	typ  int32  // handle_type
	data [maxHandleSize]byte
}

const handleHeader = int(unsafe.Offsetof(handleBuf{}.data))

// mountFD is an fd on one mount, shared by the inodes held as handles on it
// (open_by_handle_at opens within the mount of the fd it is given, and
// refuses O_PATH fds): a read-only open of the first directory seen on the
// mount. Until a mount has one, its objects are held by O_PATH fds.
type mountFD struct {
	id   uint64
	fd   int
	refs int // guarded by FS.mountsMu
}

// nameToHandle returns the file handle of the object behind fd, in the
// kernel's layout (see handleType, handleBytes).
func nameToHandle(fd int) (string, error) {
	b := handleBuf{size: maxHandleSize}
	var mnt int32
	for {
		_, _, e := unix.Syscall6(unix.SYS_NAME_TO_HANDLE_AT, uintptr(fd), uintptr(unsafe.Pointer(&emptyPath[0])),
			uintptr(unsafe.Pointer(&b)), uintptr(unsafe.Pointer(&mnt)), unix.AT_EMPTY_PATH, 0)
		if e == unix.EINTR {
			continue
		}
		if e != 0 {
			return "", e
		}
		break
	}
	if b.size > maxHandleSize {
		return "", syscall.EOVERFLOW
	}
	return string(unsafe.Slice((*byte)(unsafe.Pointer(&b)), handleHeader+int(b.size))), nil
}

// handleType is a handle's handle_type.
func handleType(h string) int32 {
	var t int32
	copy((*[4]byte)(unsafe.Pointer(&t))[:], h[4:handleHeader]) // the host's byte order
	return t
}

// handleBytes is a copy of a handle's f_handle bytes.
func handleBytes(h string) []byte { return []byte(h[handleHeader:]) }

// sysOpenByHandle opens handle h (from nameToHandle) on mount fd mountFD.
func sysOpenByHandle(mountFD int, h string, flags int) (int, syscall.Errno) {
	for {
		r, _, e := unix.Syscall(unix.SYS_OPEN_BY_HANDLE_AT, uintptr(mountFD),
			uintptr(unsafe.Pointer(unsafe.StringData(h))), uintptr(flags))
		if e == unix.EINTR {
			continue
		}
		if e != 0 {
			return -1, e
		}
		return int(r), 0
	}
}

// acquireMount returns the mount fd for mntID with a new reference, making
// one from opath (an O_PATH fd of a directory on that mount, or -1) when
// the mount has none; nil when it has none and none can be made.
func (f *FS) acquireMount(mntID uint64, opath int) *mountFD {
	f.mountsMu.Lock()
	defer f.mountsMu.Unlock()
	m := f.mounts[mntID]
	if m == nil {
		if opath < 0 {
			return nil
		}
		var b fdName
		fd, e := sysOpenat(f.procSelfFD, procName(&b, opath), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if e != 0 {
			return nil
		}
		f.inodeFDs.Add(1)
		m = &mountFD{id: mntID, fd: fd}
		f.mounts[mntID] = m
	}
	m.refs++
	return m
}

func (f *FS) releaseMount(m *mountFD) {
	f.mountsMu.Lock()
	defer f.mountsMu.Unlock()
	m.refs--
	if m.refs == 0 {
		delete(f.mounts, m.id)
		sysClose(m.fd)
		f.inodeFDs.Add(-1)
	}
}

// probeHandles checks that file handles work on the shared directory and
// returns its handle.
func probeHandles(rootFD int) (string, error) {
	h, err := nameToHandle(rootFD)
	if err != nil {
		return h, err
	}
	dfd, err := unix.Openat(rootFD, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return h, err
	}
	defer unix.Close(dfd)
	fd, e := sysOpenByHandle(dfd, h, unix.O_PATH|unix.O_CLOEXEC)
	if e != 0 {
		return h, e
	}
	unix.Close(fd)
	return h, nil
}
