package passthrough

import (
	"fmt"
	"reflect"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// DAX: the guest maps pieces of files into the device's shared-memory
// window (FUSE_SETUPMAPPING, FUSE_REMOVEMAPPING); the VMM maps the fds the
// daemon gives it (Window, vhost-user SHMEM_MAP). The daemon opens the
// node's file itself (the guest sends fh = -1 and, idmapped, no usable
// uid); a writable mapping needs a handle of the inode open for writing.
//
// Read mappings. QEMU 11.1.3 maps every fd of a SHMEM_MAP shared and
// writable, whatever its flags say: an O_RDONLY fd fails there (EACCES,
// the guest would get EIO), and through an O_RDWR fd a guest kernel could
// store into a file it mapped to read. The daemon therefore maps the file
// itself from an O_RDWR fd wherever OPEN would give the guest that fd
// anyway (OPEN reopens the node with the daemon's credentials; the guest
// kernel checks permissions, default_permissions), so such a store grants
// no write the guest could not already make with WRITE. Where OPEN would
// not (--readonly; a read-only host mount, an immutable file, a running
// executable: the O_RDWR reopen fails), the whole range is a private copy,
// made and kept fresh as a tail is (below): the guest reads the file's
// bytes and its page cache does not grow, but a host write made after the
// mapping is not seen until the slot is mapped again, and a store into it
// stays in the copy. A WRITE mapping still needs a handle of the inode
// open for writing (an honest guest asks for one only then).
//
// Files of every size. QEMU refuses a mapping that runs past the end of
// the fd's file, so a request is split: the whole pages inside the file
// are mapped from the file itself; the rest (the partial last page and the
// zeros after it, or all of a mapping wholly beyond the end) from a
// private memfd holding a copy of those bytes, the tail. What the host and
// the guest see of a tail:
//
//   - A read tail is a snapshot taken at mapping time. The daemon keeps it
//     fresh with what the guest changes through requests: WRITE (extending
//     writes under DAX go through FUSE_WRITE), SETATTR size, FALLOCATE,
//     COPY_FILE_RANGE into the file copy the changed bytes into the memfd,
//     which the VMM maps shared, so the guest sees them at once. What the
//     host (or another guest) writes to that last partial page and beyond
//     after the mapping was made is copied in when inotify reports it
//     (daxwatch.go), shortly after.
//   - A writable tail takes the guest's stores into the memfd; the daemon
//     writes the bytes [tail start, min(file size, mapping end)) back to
//     the file on FSYNC, FLUSH and RELEASE of the node, REMOVEMAPPING or
//     replacement of that slot, SETATTR size (before truncating), and
//     FUSE INIT/DESTROY. Between those points the host does not see the
//     guest's stores to the last partial page; stores past the file's end
//     are never written (as with a shared mmap of the file). A host write
//     to those bytes meanwhile is overwritten by the next write-back.
//   - The whole pages mapped from the file are the file: coherent both
//     ways. A host truncation below a live mapping makes a guest access
//     past the new end fault in the VMM (SIGBUS in QEMU): the daemon
//     cannot prevent it. A guest truncation leaves them mapped too, but
//     the guest does not touch its file past its own size.
//
// A SETUPMAPPING lies inside one 2 MiB slot (Linux maps exactly a slot)
// and costs the window at most two mappings, so two memory regions of the
// VMM: the file's part and the tail. The table of what is mapped has one
// list per slot; replacing part of a slot unmaps every mapping of it that
// the new one overlaps (whole), writing writable tails back first.
//
// Each tail keeps an fd of the file (O_RDONLY or O_RDWR, for the refreshes
// and write-backs) and its memfd: at most two fds per live mapping, not
// counted in the inode fd budget (Stats.MapFDs). A node's tails are found
// from the inode (inode.tails: without a window nil for every inode, and
// WRITE pays one atomic load of a bool; with one, made at a file's first
// change or mapping, and its mutex orders changes, copies and write-backs).

// Window is the DAX window (internal/vhostuser's *Window): see
// Options.Window.
type Window interface {
	// Size is the window's length in bytes.
	Size() uint64
	// Map maps length bytes of fd at fdOffset into the window at
	// winOffset, unmapping every mapping it overlaps first; the fd is
	// only borrowed.
	Map(fd int, fdOffset, winOffset, length uint64, writable bool) error
	// Unmap removes every mapping inside [winOffset, winOffset+length).
	Unmap(winOffset, length uint64) error
	// UnmapAll removes every mapping, ignoring the VMM's failures.
	UnmapAll()
}

// The words of Options.InodeDAX (--inode-dax).
const (
	InodeDAXAll  = "all"  // every regular file gets FUSE_ATTR_DAX
	InodeDAXFlag = "flag" // only those whose host file has FS_XFLAG_DAX
)

const (
	daxPage     = 4096
	daxSlotSize = 2 << 20 // Linux's DAX range (FUSE_DAX_SHIFT 21)
	mapWrite    = 1       // FUSE_SETUPMAPPING_FLAG_WRITE
	// maxSlotMappings bounds the mappings of one slot (page-sized ones).
	maxSlotMappings = daxSlotSize / daxPage
)

// daxTable is what is mapped in the window, by 2 MiB slot.
type daxTable struct {
	on  atomic.Bool // a window is set
	mu  sync.Mutex  // guards everything below; taken before a tails.mu
	win Window
	// slots[k] holds the mappings inside [k*2MiB, (k+1)*2MiB).
	slots [][]*mapping
	size  uint64       // the window's (set before any request, read without mu)
	fds   atomic.Int64 // tails' fds (file and memfd)
	// watch follows host writes under read tails (daxwatch.go); nil
	// without a window or without inotify. Set before any request.
	watch *tailWatch
}

// mapping is one SETUPMAPPING the window holds.
type mapping struct {
	moffset, length uint64
	foffset         uint64
	writable        bool
	ino             *inode
	tail            *tail // nil when the file covers the whole range
}

// tail is the memfd copy of the part of a mapping past the file's last
// whole page.
type tail struct {
	fd       int    // the file, O_RDONLY or O_RDWR
	memfd    int    // sized len(mem)
	mem      []byte // the memfd, mapped shared
	start    uint64 // the file offset mem[0] stands for
	writable bool
}

// nodeTails is an inode's tails; made at the inode's first tail and kept.
type nodeTails struct {
	mu    sync.Mutex
	tails []*tail
}

// SetWindow sets the DAX window (Options.Window), for a daemon that gets it
// only after making the file system. Call it before the first request.
func (f *FS) SetWindow(w Window) {
	if v := reflect.ValueOf(w); w != nil && v.Kind() == reflect.Pointer && v.IsNil() {
		w = nil // a nil *vhostuser.Window: no window
	}
	t := &f.dax
	t.mu.Lock()
	defer t.mu.Unlock()
	t.win = w
	t.slots, t.size = nil, 0
	if w != nil && w.Size() > 0 {
		t.size = w.Size()
		t.slots = make([][]*mapping, (t.size+daxSlotSize-1)/daxSlotSize)
		if t.watch == nil {
			t.watch = f.startTailWatch()
		}
	}
	t.on.Store(t.slots != nil)
}

// WindowSize returns the DAX window's size, 0 without one
// (fuse.Windowed).
func (f *FS) WindowSize() uint64 {
	t := &f.dax
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.win == nil {
		return 0
	}
	return t.win.Size()
}

func checkInodeDAX(s string) error {
	switch s {
	case "", InodeDAXAll, InodeDAXFlag:
		return nil
	}
	return fmt.Errorf("unknown --inode-dax %q (all|flag)", s)
}

// SetupMapping maps length bytes of node h.NodeId's file at foffset into the
// window at moffset (see the comment at the top of dax.go).
func (f *FS) SetupMapping(h *gofuse.InHeader, fh, foffset, length, flags, moffset uint64) syscall.Errno {
	t := &f.dax
	if !t.on.Load() {
		return syscall.ENOSYS
	}
	size := t.size
	switch {
	case flags&^3 != 0, length == 0, (moffset|length|foffset)%daxPage != 0,
		moffset >= size, length > size-moffset, foffset > 1<<63-length:
		return syscall.EINVAL // the server checks these too
	case moffset/daxSlotSize != (moffset+length-1)/daxSlotSize:
		return syscall.EINVAL
	}
	writable := flags&mapWrite != 0
	if writable && f.opts.ReadOnly {
		return syscall.EROFS
	}
	i, errno := f.getInode(h.NodeId)
	if errno != 0 {
		return errno
	}
	defer i.put()
	if !i.isReg() {
		return syscall.EINVAL
	}
	if fh != ^uint64(0) {
		hd, errno := f.fileHandle(fh, h.NodeId)
		if errno != 0 {
			return errno
		}
		hd.put()
	}
	switch {
	case i.handles.Load() <= 0:
		return syscall.EBADF
	case writable && i.writers.Load() <= 0:
		return syscall.EACCES
	}
	// The VMM maps whatever fd it gets shared and writable (see "Read
	// mappings" above): the file itself only where OPEN would let the
	// guest write it.
	fromFile := !f.opts.ReadOnly
	fd := -1
	if fromFile {
		fd, errno = f.reopen(i, unix.O_RDWR)
		if errno != 0 && !writable {
			fromFile = false // e.g. ETXTBSY: a private copy will do
		} else if errno != 0 {
			return errno
		}
	}
	if !fromFile {
		if fd, errno = f.reopen(i, unix.O_RDONLY); errno != 0 {
			return errno
		}
	}
	m := &mapping{moffset: moffset, length: length, foffset: foffset, writable: writable, ino: i.inode}
	errno, owned := f.mapFile(m, fd, fromFile)
	if !owned {
		sysClose(fd)
	}
	return errno
}

// mapFile maps m from fd (O_RDWR with fromFile, else O_RDONLY), through a
// tail for what lies past the file's last whole page, or all of it through
// a tail without fromFile, and records it, replacing the mappings of its
// slot it overlaps. owned: a tail took fd (on success with a tail; m may
// be gone again by the time the caller looks).
func (f *FS) mapFile(m *mapping, fd int, fromFile bool) (errno syscall.Errno, owned bool) {
	var st syscall.Stat_t
	if errno := sysFstat(fd, &st); errno != 0 {
		return errno, false
	}
	whole := uint64(max(st.Size, 0)) &^ (daxPage - 1)
	var fileLen uint64
	if fromFile && m.foffset < whole {
		fileLen = min(m.length, whole-m.foffset)
	}
	if fileLen < m.length {
		tl, errno := f.newTail(m.ino, fd, m.foffset+fileLen, m.length-fileLen, m.writable)
		if errno != 0 {
			return errno, false
		}
		m.tail = tl
	}
	t := &f.dax
	t.mu.Lock()
	defer t.mu.Unlock()
	errno = t.evict(m.moffset, m.length)
	if errno == 0 && len(t.slots[m.moffset/daxSlotSize]) >= maxSlotMappings {
		errno = syscall.ENOSPC
	}
	if errno == 0 && fileLen > 0 {
		errno = winErrno(t.win.Map(fd, m.foffset, m.moffset, fileLen, m.writable))
	}
	if errno == 0 && m.tail != nil {
		tl := m.tail
		if errno = winErrno(t.win.Map(tl.memfd, 0, m.moffset+fileLen, uint64(len(tl.mem)), m.writable)); errno != 0 && fileLen > 0 {
			t.win.Unmap(m.moffset, fileLen)
		}
	}
	if errno != 0 {
		if m.tail != nil {
			f.dropTail(m.ino, m.tail, false) // the caller closes fd
			m.tail = nil
		}
		return errno, false
	}
	k := m.moffset / daxSlotSize
	t.slots[k] = append(t.slots[k], m)
	return 0, m.tail != nil
}

// winErrno is the errno of a Window error (unix.Errno by contract).
func winErrno(err error) syscall.Errno {
	if err == nil {
		return 0
	}
	if e, ok := err.(syscall.Errno); ok {
		return e
	}
	return syscall.EIO
}

// newTail makes the tail of a mapping of i: a memfd of length bytes holding
// the file's bytes from start (zeros past its end), attached to i's tails
// before the copy is taken, so that a change made meanwhile is copied in
// by its refresh.
func (f *FS) newTail(i *inode, fd int, start, length uint64, writable bool) (*tail, syscall.Errno) {
	memfd, err := unix.MemfdCreate("govirtiofsd-dax-tail", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, toErrno(err)
	}
	if errno := sysFtruncate(memfd, int64(length)); errno != 0 {
		sysClose(memfd)
		return nil, errno
	}
	mem, err := unix.Mmap(memfd, 0, int(length), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		sysClose(memfd)
		return nil, toErrno(err)
	}
	tl := &tail{fd: fd, memfd: memfd, mem: mem, start: start, writable: writable}
	f.dax.fds.Add(2)
	if !writable {
		f.dax.watch.add(i, tl) // before the copy: no host write after it is missed
	}
	nt := i.lockTails()
	nt.tails = append(nt.tails, tl)
	errno := tl.refresh(start, length)
	nt.mu.Unlock()
	if errno != 0 {
		f.dropTail(i, tl, false) // fd is the caller's
		return nil, errno
	}
	return tl, 0
}

// refresh copies the file's bytes [off, off+n) that the tail holds into it,
// zeros past the file's end. The caller holds the node's tails.mu.
func (tl *tail) refresh(off, n uint64) syscall.Errno {
	end := tl.start + uint64(len(tl.mem))
	lo, hi := max(off, tl.start), end
	if n < end-min(off, end) {
		hi = off + n
	}
	if lo >= hi {
		return 0
	}
	b := tl.mem[lo-tl.start : hi-tl.start]
	for len(b) > 0 {
		r, err := unix.Pread(tl.fd, b, int64(lo))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return toErrno(err)
		}
		if r == 0 {
			clear(b) // past the end of the file
			break
		}
		b, lo = b[r:], lo+uint64(r)
	}
	return 0
}

// writeBack writes a writable tail's bytes that lie inside the file back
// to it. The caller holds the node's tails.mu.
func (tl *tail) writeBack() syscall.Errno {
	if !tl.writable {
		return 0
	}
	var st syscall.Stat_t
	if errno := sysFstat(tl.fd, &st); errno != 0 {
		return errno
	}
	size := uint64(max(st.Size, 0))
	if size <= tl.start {
		return 0
	}
	b := tl.mem[:min(uint64(len(tl.mem)), size-tl.start)]
	off := int64(tl.start)
	for len(b) > 0 {
		w, err := unix.Pwrite(tl.fd, b, off)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return toErrno(err)
		}
		b, off = b[w:], off+int64(w)
	}
	return 0
}

// dropTail detaches tl from i's tails and closes it, and its file fd with
// closeFile.
func (f *FS) dropTail(i *inode, tl *tail, closeFile bool) {
	f.dax.watch.remove(tl)
	if nt := i.tails.Load(); nt != nil {
		nt.mu.Lock()
		for k, x := range nt.tails {
			if x == tl {
				nt.tails = append(nt.tails[:k], nt.tails[k+1:]...)
				break
			}
		}
		nt.mu.Unlock()
	}
	unix.Munmap(tl.mem)
	sysClose(tl.memfd)
	if closeFile {
		sysClose(tl.fd)
	}
	f.dax.fds.Add(-2)
}

// freeTail drops m's tail, if any. The caller holds t.mu.
func (t *daxTable) freeTail(m *mapping) {
	if m.tail != nil {
		m.ino.fs.dropTail(m.ino, m.tail, true)
		m.tail = nil
	}
}

// cuts reports whether a recorded mapping straddles an edge of
// [moffset, moffset+length): such a range cannot be removed without
// leaving half a mapping. The caller holds t.mu.
func (t *daxTable) cuts(moffset, length uint64) bool {
	end := moffset + length
	for k := moffset / daxSlotSize; k <= (end-1)/daxSlotSize; k++ {
		for _, m := range t.slots[k] {
			if m.moffset < end && moffset < m.moffset+m.length &&
				(m.moffset < moffset || m.moffset+m.length > end) {
				return true
			}
		}
	}
	return false
}

// evict removes the recorded mappings overlapping [moffset, moffset+length)
// (whole: the caller checked cuts, or replaces them), writing their
// writable tails back first, and asks the window to unmap them; a mapping
// the window fails to unmap stays recorded and its error is the answer.
// The caller holds t.mu.
func (t *daxTable) evict(moffset, length uint64) syscall.Errno {
	end := moffset + length
	var first syscall.Errno
	for k := moffset / daxSlotSize; k <= (end-1)/daxSlotSize; k++ {
		kept := t.slots[k][:0]
		for _, m := range t.slots[k] {
			if m.moffset >= end || moffset >= m.moffset+m.length {
				kept = append(kept, m)
				continue
			}
			m.ino.writeBackTail(m.tail)
			if errno := winErrno(t.win.Unmap(m.moffset, m.length)); errno != 0 {
				kept = append(kept, m)
				if first == 0 {
					first = errno
				}
				continue
			}
			t.freeTail(m)
		}
		clear(t.slots[k][len(kept):])
		t.slots[k] = kept
	}
	return first
}

// writeBackTail writes tl back (nil: nothing) under i's tails.mu.
func (i *inode) writeBackTail(tl *tail) {
	if tl == nil || !tl.writable {
		return
	}
	nt := i.tails.Load()
	nt.mu.Lock()
	if errno := tl.writeBack(); errno != 0 {
		i.fs.log.Warn("passthrough: DAX: writing a mapped tail back failed", "node", i.id, "offset", tl.start, "err", errno)
	}
	nt.mu.Unlock()
}

// MapRange is a range of the window, one entry of a REMOVEMAPPING. The
// same unnamed struct type as internal/fuse.MapRange.
type MapRange = struct{ Moffset, Len uint64 }

// RemoveMapping removes the mappings inside each of ranges: all of them,
// or none when a range is not one of the window's or cuts through a
// mapping (EINVAL). Linux counts the ranges free whatever the answer, so
// a window that fails to unmap one does not stop the others: the first
// such error is the answer.
func (f *FS) RemoveMapping(ranges []MapRange) syscall.Errno {
	t := &f.dax
	if !t.on.Load() {
		return syscall.ENOSYS
	}
	size := t.size
	for _, r := range ranges {
		if r.Len == 0 || (r.Moffset|r.Len)%daxPage != 0 || r.Moffset >= size || r.Len > size-r.Moffset {
			return syscall.EINVAL
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, r := range ranges {
		if t.cuts(r.Moffset, r.Len) {
			return syscall.EINVAL
		}
	}
	var first syscall.Errno
	for _, r := range ranges {
		errno := t.evict(r.Moffset, r.Len)
		// Whatever the window holds there that the table does not
		// (nothing, unless a Map failed half way).
		if errno == 0 {
			errno = winErrno(t.win.Unmap(r.Moffset, r.Len))
		}
		if first == 0 {
			first = errno
		}
	}
	return first
}

// resetDAX forgets every mapping, writing writable tails back, and asks the
// window to unmap them all (unmap: INIT and DESTROY; not at Close).
func (f *FS) resetDAX(unmap bool) {
	t := &f.dax
	if !t.on.Load() {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for k, ms := range t.slots {
		for _, m := range ms {
			m.ino.writeBackTail(m.tail)
			t.freeTail(m)
		}
		clear(ms)
		t.slots[k] = ms[:0]
	}
	if unmap {
		t.win.UnmapAll()
	}
}

// MapStats reports the live mappings and the fds their tails hold.
func (f *FS) MapStats() (mappings, fds int) {
	t := &f.dax
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, ms := range t.slots {
		mappings += len(ms)
	}
	return mappings, int(t.fds.Load())
}

// --- keeping tails fresh ---

// lockTails returns i's tails locked, made if i has none yet. With a
// window, every change of a file's data through a request (WRITE,
// SETATTR size, FALLOCATE, COPY_FILE_RANGE) runs under it, so that a tail
// being made (its copy taken under it) never misses one, and a write-back
// never lands between a change and its refresh. Without a window nothing
// calls it: inodes stay without.
func (i *inode) lockTails() *nodeTails {
	nt := i.tails.Load()
	if nt == nil {
		i.tails.CompareAndSwap(nil, &nodeTails{})
		nt = i.tails.Load()
	}
	nt.mu.Lock()
	return nt
}

// tailsChanged refreshes i's tails over [off, off+n) after a change of the
// file, and unlocks nt (lockTails' answer).
func (i *inode) tailsChanged(nt *nodeTails, off, n uint64) {
	for _, tl := range nt.tails {
		if errno := tl.refresh(off, n); errno != 0 {
			i.fs.log.Warn("passthrough: DAX: refreshing a mapped tail failed", "node", i.id, "offset", tl.start, "err", errno)
		}
	}
	nt.mu.Unlock()
}

// writeBackTails writes i's writable tails back to the file (FSYNC, FLUSH,
// RELEASE, and before a truncation with nt held: then it does not lock).
func (i *inode) writeBackTails(nt *nodeTails, locked bool) syscall.Errno {
	if nt == nil {
		return 0
	}
	if !locked {
		nt.mu.Lock()
		defer nt.mu.Unlock()
	}
	var first syscall.Errno
	for _, tl := range nt.tails {
		if errno := tl.writeBack(); errno != 0 && first == 0 {
			first = errno
		}
	}
	return first
}

// --- FUSE_ATTR_DAX ---

// fsxattr is struct fsxattr (linux/fs.h), which FS_IOC_FSGETXATTR fills.
type fsxattr struct {
	xflags, extsize, nextents, projid, cowextsize uint32
	_                                             [8]byte
}

const (
	// fsIocFsGetXattr is FS_IOC_FSGETXATTR, _IOR('X', 31, struct fsxattr).
	fsIocFsGetXattr = 2<<30 | uintptr(unsafe.Sizeof(fsxattr{}))<<16 | 'X'<<8 | 31
	fsXflagDAX      = 0x8000 // FS_XFLAG_DAX
)

// daxFlag values (inode.daxFlag): FS_XFLAG_DAX not read yet, set, clear.
const (
	daxFlagUnknown uint32 = iota
	daxFlagSet
	daxFlagClear
)

// setAttrDAX adds FUSE_ATTR_DAX to a's flags when the session negotiated
// HAS_INODE_DAX and i is a regular file to map (every one with
// InodeDAX "all", those with FS_XFLAG_DAX with "flag").
func (f *FS) setAttrDAX(i *inode, a *gofuse.Attr) {
	if f.caps.Load()&gofuse.CAP_HAS_INODE_DAX == 0 || !i.isReg() {
		return
	}
	if f.opts.InodeDAX == InodeDAXFlag && !f.hasDAXFlag(i) {
		return
	}
	a.Flags |= gofuse.ATTR_DAX
}

// hasDAXFlag reads the host file's FS_XFLAG_DAX (FS_IOC_FSGETXATTR needs an
// open fd), once per inode: the guest reads FUSE_ATTR_DAX when it makes
// the inode, so a flag changed on the host later takes effect when the
// guest looks the file up anew after forgetting it.
func (f *FS) hasDAXFlag(i *inode) bool {
	switch i.daxFlag.Load() {
	case daxFlagSet:
		return true
	case daxFlagClear:
		return false
	}
	r, errno := f.pathOf(i)
	if errno != 0 {
		return false
	}
	defer r.put()
	fd, errno := f.reopen(r, unix.O_RDONLY|unix.O_NONBLOCK)
	switch errno {
	case 0:
	case syscall.EMFILE, syscall.ENFILE, syscall.ENOMEM, syscall.EINTR:
		return false // ask again next time
	default:
		i.daxFlag.Store(daxFlagClear) // not openable: not to be mapped either
		return false
	}
	defer sysClose(fd)
	var fsx fsxattr
	_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), fsIocFsGetXattr, uintptr(unsafe.Pointer(&fsx)))
	v := daxFlagClear
	if e == 0 && fsx.xflags&fsXflagDAX != 0 {
		v = daxFlagSet
	}
	if e == 0 || e == syscall.ENOTTY || e == syscall.EOPNOTSUPP || e == syscall.EINVAL {
		i.daxFlag.Store(v) // a file system without the ioctl never has the flag
	}
	return v == daxFlagSet
}
