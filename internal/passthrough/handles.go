package passthrough

import (
	"encoding/binary"

	"golang.org/x/sys/unix"
)

// File handle mode (--inode-file-handles=prefer|mandatory): an inode is
// held as a file handle (name_to_handle_at) instead of an O_PATH fd, so the
// guest's lookups do not pin one fd each; each request that needs the object
// opens it with open_by_handle_at (CAP_DAC_READ_SEARCH) on an fd of its
// mount. Handles only ever come from the daemon's own name_to_handle_at,
// never from the guest. An object deleted on the host gives ESTALE.

type fileHandle struct {
	h   unix.FileHandle
	mnt *mountFD
}

// mountFD is an fd on one mount, shared by the inodes held as handles on it
// (open_by_handle_at opens within the mount of the fd it is given, and
// refuses O_PATH fds): a read-only open of the first directory seen on the
// mount. Until a mount has one, its objects are held by O_PATH fds.
type mountFD struct {
	id   uint64
	fd   int
	refs int // guarded by FS.mountsMu
}

func nameToHandle(fd int) (unix.FileHandle, error) {
	h, _, err := unix.NameToHandleAt(fd, "", unix.AT_EMPTY_PATH)
	return h, err
}

func handleKey(h unix.FileHandle) string {
	b := h.Bytes()
	k := make([]byte, 4+len(b))
	binary.LittleEndian.PutUint32(k, uint32(h.Type()))
	copy(k[4:], b)
	return string(k)
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
func probeHandles(rootFD int) (unix.FileHandle, error) {
	h, err := nameToHandle(rootFD)
	if err != nil {
		return h, err
	}
	dfd, err := unix.Openat(rootFD, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return h, err
	}
	defer unix.Close(dfd)
	fd, err := unix.OpenByHandleAt(dfd, h, unix.O_PATH|unix.O_CLOEXEC)
	if err != nil {
		return h, err
	}
	unix.Close(fd)
	return h, nil
}
