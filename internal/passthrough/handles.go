package passthrough

import (
	"errors"
	"fmt"
	"maps"
	"strings"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// File handle mode (--inode-file-handles=prefer|mandatory): an inode is
// held as a file handle (name_to_handle_at) instead of an O_PATH fd, so the
// guest's lookups do not pin one fd each; each request that needs the object
// opens it with open_by_handle_at (CAP_DAC_READ_SEARCH) on an fd of its
// mount. An object deleted on the host gives ESTALE.
//
// Which handles are opened: open_by_handle_at with CAP_DAC_READ_SEARCH
// opens any object of the file system, wherever it is, so the daemon opens
// only
//   - handles it made itself, at LOOKUP (and READDIRPLUS, CREATE, ...):
//     keyFor encodes them with name_to_handle_at on the O_PATH fd of an
//     object it has just reached inside the share, one validated name at
//     a time from its parent; the guest never sees nor sends a handle;
//   - the handles of a migration stream in file-handles mode, which are
//     checked to open an object inside the share first (insideShare, in
//     load.go).
//
// Which file systems: the decision is per mount, made once and logged
// once. A mount whose file system cannot encode handles (overlayfs
// without nfs_export, many FUSE and network file systems:
// name_to_handle_at fails) or cannot open them (open_by_handle_at fails
// on its first directory, as it does on every mount when the daemon lacks
// CAP_DAC_READ_SEARCH in the host's user namespace, or dropped it at start
// because the share's own file system gave no handles) is decided for fds:
// its objects are held by O_PATH fds from then on, without
// asking again (mountModes). The decision is made on the first directory
// seen on the mount, in practice its root, before any of its objects is
// interned. --inode-file-handles=mandatory answers EOPNOTSUPP there
// instead.
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

// handleBuf is a struct file_handle with room for any handle: LOOKUP
// encodes into one on its stack, so a lookup of an inode the guest already
// holds allocates nothing.
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

// encode is name_to_handle_at(fd, "", AT_EMPTY_PATH) into b.
func (b *handleBuf) encode(fd int) syscall.Errno {
	_, e := b.encodeAt(fd, 0)
	return e
}

// encodeAt is name_to_handle_at(fd, "", AT_EMPTY_PATH|flags) into b; it
// returns the mount id the kernel reports with the handle.
func (b *handleBuf) encodeAt(fd, flags int) (int32, syscall.Errno) {
	return b.encodeName(fd, &emptyPath[0], unix.AT_EMPTY_PATH|flags)
}

// encodeName is name_to_handle_at(dirfd, path, flags) into b (without
// AT_SYMLINK_FOLLOW a trailing symlink is not followed); it returns the
// mount id the kernel reports with the handle.
func (b *handleBuf) encodeName(dirfd int, path *byte, flags int) (int32, syscall.Errno) {
	var mnt int32
	for {
		b.size = maxHandleSize
		_, _, e := unix.Syscall6(unix.SYS_NAME_TO_HANDLE_AT, uintptr(dirfd), uintptr(unsafe.Pointer(path)),
			uintptr(unsafe.Pointer(b)), uintptr(unsafe.Pointer(&mnt)), uintptr(flags), 0)
		if e == unix.EINTR {
			continue
		}
		if e == 0 && b.size > maxHandleSize {
			return mnt, syscall.EOVERFLOW
		}
		return mnt, e
	}
}

// view is the handle in the key's layout (the kernel's struct
// file_handle), without a copy: valid while b is, for a table lookup only
// (ownedKey copies it).
func (b *handleBuf) view() string {
	return unsafe.String((*byte)(unsafe.Pointer(b)), handleHeader+int(b.size))
}

// nameToHandle returns the file handle of the object behind fd, in the
// kernel's layout (see handleType, handleBytes).
func nameToHandle(fd int) (string, error) {
	var b handleBuf
	if e := b.encode(fd); e != 0 {
		return "", e
	}
	return strings.Clone(b.view()), nil
}

// ownedKey is k with its handle copied: a key that may be kept. It is
// built field by field, so that k's handle (a view of a handleBuf on the
// caller's stack) does not flow into the result and move that buffer to
// the heap.
func ownedKey(k *inodeKey) inodeKey {
	return inodeKey{dev: k.dev, ino: k.ino, mntID: k.mntID, handle: strings.Clone(k.handle)}
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

// mountHandles says whether the objects of mount mntID are held by file
// handle: known is false until the mount is decided (decideMount). Lock-
// free: it runs on every LOOKUP in file handle mode.
func (f *FS) mountHandles(mntID uint64) (handles, known bool) {
	m := f.mountModes.Load()
	if m == nil {
		return false, false
	}
	handles, known = (*m)[mntID]
	return handles, known
}

// decideMount decides mount mntID from dir, an O_PATH fd of a directory
// on it: handles if its file system encodes dir's handle and
// open_by_handle_at opens it. It logs the mounts that get fds, once each.
// A mount id the kernel reuses for a later mount keeps the decision: a
// mount wrongly held by fds is only costlier; one wrongly held by handles
// fails its lookups' open_by_handle_at (ESTALE or EOPNOTSUPP), never opens
// another object. It returns the decision.
func (f *FS) decideMount(mntID uint64, dir int) bool {
	var b fdName
	fd, e := sysOpenat(f.procSelfFD, procName(&b, dir), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if e != 0 {
		return true // cannot tell now: a later directory will
	}
	defer sysClose(fd)
	h, err := nameToHandle(dir)
	why := "name_to_handle_at fails on this file system"
	if err == nil {
		if err = canOpenHandle(fd, h); err != nil {
			why = openHandleWhy(err)
		}
	}
	f.setMountHandles(mntID, err == nil, why, err)
	return err == nil
}

// setMountHandles records the decision for mount mntID (the first one
// stands) and logs a mount that gets fds.
func (f *FS) setMountHandles(mntID uint64, handles bool, why string, err error) {
	f.mountsMu.Lock()
	defer f.mountsMu.Unlock()
	old := f.mountModes.Load()
	if old != nil {
		if _, ok := (*old)[mntID]; ok {
			return
		}
	}
	m := map[uint64]bool{mntID: handles}
	if old != nil {
		maps.Copy(m, *old)
	}
	f.mountModes.Store(&m) // copy on write: mounts are few, readers many
	if handles {
		return
	}
	held := "O_PATH fds"
	if f.opts.InodeFileHandles == FileHandlesMandatory {
		held = "refused (--inode-file-handles=mandatory)"
	}
	f.log.Info("passthrough: no inode file handles on this mount: its inodes are "+held,
		"mount_id", mntID, "why", why, "err", err)
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

// canOpenHandle opens h on mountFD as an O_PATH fd and closes it: what
// every request on an inode held by handle does. Without O_DIRECTORY the
// kernel asks for CAP_DAC_READ_SEARCH in the host's user namespace (the
// relaxed check of Linux 6.10 for a mount's owner covers directories only,
// and an inode can be anything).
func canOpenHandle(mountFD int, h string) error {
	fd, e := sysOpenByHandle(mountFD, h, unix.O_PATH|unix.O_CLOEXEC)
	if e != 0 {
		return e
	}
	unix.Close(fd)
	return nil
}

func openHandleWhy(err error) string {
	if errors.Is(err, syscall.EPERM) {
		return "open_by_handle_at needs CAP_DAC_READ_SEARCH in the host's user namespace, which this process does not hold"
	}
	return "open_by_handle_at fails on this file system"
}

// ErrHandlesNotPermitted is ProbeFileHandles' answer when the file system
// gives handles but this process may not open them.
var ErrHandlesNotPermitted = errors.New("open_by_handle_at is not permitted: it needs CAP_DAC_READ_SEARCH in the host's user namespace")

// ProbeFileHandles tells whether this process can hold the inodes of dir's
// file system as file handles: nil if it can, an error wrapping
// ErrHandlesNotPermitted if only the capability is missing, and otherwise
// why the file system gives none.
func ProbeFileHandles(dir string) error {
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	_, err = probeHandles(fd)
	return err
}

// probeHandles checks that file handles work on the directory rootFD (an
// O_PATH fd) and returns its handle.
func probeHandles(rootFD int) (string, error) {
	h, err := nameToHandle(rootFD)
	if err != nil {
		return h, fmt.Errorf("name_to_handle_at: %w", err)
	}
	dfd, err := unix.Openat(rootFD, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return h, err
	}
	defer unix.Close(dfd)
	if err := canOpenHandle(dfd, h); err != nil {
		if errors.Is(err, syscall.EPERM) {
			return h, fmt.Errorf("%w (%w)", ErrHandlesNotPermitted, err)
		}
		return h, fmt.Errorf("open_by_handle_at: %w", err)
	}
	return h, nil
}
