package passthrough

import (
	"sync"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// inodeKey identifies a host object: the same (dev, ino) on two mounts of
// one file system are different objects to the guest (they may have
// different mount options), as in the C and Rust daemons.
type inodeKey struct {
	dev   uint64 // staleDev for a stale inode's key (ino is then its node id)
	ino   uint64
	mntID uint64
	// handle is the file handle in file handle mode (nameToHandle: the
	// inode's only copy of it): without an fd pinning the object, an
	// inode number can be reused by a new file, which the handle's
	// generation tells apart.
	handle string
}

// staleDev is the device of a stale inode's key, which is then unique and
// equals no host object's key: a device number from statx fits in 44 bits.
const staleDev = ^uint64(0)

func keyOf(st *unix.Statx_t) inodeKey {
	return inodeKey{
		dev:   uint64(unix.Mkdev(st.Dev_major, st.Dev_minor)),
		ino:   st.Ino,
		mntID: st.Mnt_id,
	}
}

// sameObject compares the host identity, ignoring the file handle.
func (k inodeKey) sameObject(o inodeKey) bool {
	return k.dev == o.dev && k.ino == o.ino && k.mntID == o.mntID
}

func (k inodeKey) hash() uint32 {
	h := k.ino*0x9e3779b97f4a7c15 ^ k.dev*0xbf58476d1ce4e5b9 ^ k.mntID*0x94d049bb133111eb
	return uint32(h>>32) ^ uint32(h)
}

// inode is one host object the guest holds lookups on. It lives as long as
// anything refers to it: the table (while the guest's lookup count is above
// zero), each request using it, and each open handle. Held by fd, its
// O_PATH fd is resident while it has one (see ref and budget.go).
type inode struct {
	id  uint64
	key inodeKey
	// ref packs the use count and the resident O_PATH fd (refWord).
	ref atomic.Uint64
	// mnt is the mount fd key.handle opens on when the inode is held as a
	// file handle; nil when it is held by fd.
	mnt   *mountFD
	ftype uint16 // S_IFMT bits; an object's type never changes
	// pinned inodes (the root) ignore nlookup.
	pinned bool
	// stale inodes were restored by a migration (MigrationGuestError)
	// without a host object: no fd, mnt nil, and every request on them
	// answers ESTALE; FORGET still drops them.
	stale bool
	// wait caches fileWait for the object's file system, which never
	// changes either.
	wait atomic.Uint32
	// handles counts the open handles on the inode, each holding a use
	// reference that never touches the inode's fd: the budget's sweep
	// may evict an inode whose references are the table's and these
	// (tryEvict). A handle adds to it after taking its reference and
	// takes from it before dropping it.
	handles atomic.Int32
	// writers counts those of the handles open for writing (a writable
	// DAX mapping needs one).
	writers atomic.Int32
	// tails are the inode's DAX tail copies (dax.go), nil until its
	// first; daxFlag caches its host file's FS_XFLAG_DAX.
	tails   atomic.Pointer[nodeTails]
	daxFlag atomic.Uint32

	// name is where the daemon last saw the object (held by fd only),
	// for reopening it once evicted; nil: nameless, never evicted.
	name atomic.Pointer[inodeName]
	// fid is the object's AT_HANDLE_FID identity, read at its first
	// eviction where the file system gives one.
	fid atomic.Pointer[string]

	// nlookup is the guest's lookup count, guarded by the key shard's
	// mutex.
	nlookup uint64

	locks atomic.Pointer[posixLocks] // made at the first POSIX lock

	fs *FS

	// keyNext chains the inodes of one bucket of the key shard
	// (keyShard), guarded by its mutex.
	keyNext *inode
}

func (i *inode) tableID() uint64      { return i.id }
func (i *inode) setTableID(id uint64) { i.id = id }

// inode.wait values.
const (
	waitUnknown uint32 = iota
	waitBounded
	waitMayWait
)

// fileWait says how I/O on the object is issued (see the function
// fileWait); fd is any fd of it, consulted only until the answer is known.
func (i *inode) fileWait(fd int) bufvec.Wait {
	switch i.wait.Load() {
	case waitBounded:
		return bufvec.Bounded
	case waitMayWait:
		return bufvec.MayWait
	}
	w, ok := fileWait(fd)
	switch {
	case !ok: // ask again next time
	case w == bufvec.Bounded:
		i.wait.Store(waitBounded)
	default:
		i.wait.Store(waitMayWait)
	}
	return w
}

// inheritWait gives i, an object just created in directory dir (dirFD is
// an fd of dir), dir's answer: one fstatfs per directory, not per file.
func (i *inode) inheritWait(dir *inode, dirFD int) {
	if i.wait.Load() == waitUnknown {
		dir.fileWait(dirFD)
		i.wait.CompareAndSwap(waitUnknown, dir.wait.Load())
	}
}

func (i *inode) isDir() bool     { return i.ftype == unix.S_IFDIR }
func (i *inode) isReg() bool     { return i.ftype == unix.S_IFREG }
func (i *inode) isSymlink() bool { return i.ftype == unix.S_IFLNK }

// tryRef takes a use reference unless the inode is already being torn down.
func (i *inode) tryRef() bool {
	_, ok := i.acquire()
	return ok
}

// tryRef adds a reference to count unless it has dropped to zero: the
// last put has torn the object down (or is about to).
func tryRef(count *atomic.Int64) bool {
	for {
		r := count.Load()
		if r <= 0 {
			return false
		}
		if count.CompareAndSwap(r, r+1) {
			return true
		}
	}
}

// put drops a reference; the last one closes the fds.
func (i *inode) put() {
	if w := i.ref.Add(^uint64(0)); wordCount(w) == 0 {
		i.teardown(w)
	}
}

// teardown closes what the inode holds once its last reference (final
// word w) is gone.
func (i *inode) teardown(w uint64) {
	i.fs.dropLocks(i)
	if fd := wordFD(w); fd >= 0 {
		sysClose(fd)
		i.fs.inodeFDs.Add(-1)
		switch {
		case i.pinned:
		case i.mnt != nil: // a directory's cached fd (dircache.go)
			i.fs.dirs.fds.Add(-1)
		default:
			i.fs.residentFDs.Add(-1)
		}
	} else if i.mnt == nil && !i.stale {
		i.fs.evictedNow.Add(-1)
	}
	if i.mnt != nil {
		i.fs.releaseMount(i.mnt)
	}
}

// iref is an inode with a use reference and an O_PATH fd for it: the
// inode's resident fd (which the reference keeps from eviction), or one
// opened for this request (file handle mode, or reopened over budget).
type iref struct {
	*inode
	fd      int
	ownedFD bool
}

// closePath closes a per-request fd (the use reference stays).
func (r *iref) closePath() {
	if r.ownedFD {
		sysClose(r.fd)
		r.ownedFD = false
	}
}

// put closes a per-request fd and drops the use reference.
func (r iref) put() {
	r.closePath()
	r.inode.put()
}

const keyShards = 64

type handleKind uint8

const (
	handleFile handleKind = iota
	handleDir
)

// handle is an open file or directory.
type handle struct {
	id    uint64
	fd    int
	ino   *inode // a reference is held for the handle's lifetime
	kind  handleKind
	flags int // host open flags
	// writer: counted in ino.writers (open for writing).
	writer bool
	wait   bufvec.Wait // how READ and WRITE issue their syscalls (fileWait)
	refs   atomic.Int64

	dir *dirStream // directories only

	// stale handles were restored by a migration without an open file
	// (fd is -1): every request on them answers ESTALE, RELEASE frees
	// them.
	stale bool
	// flocked is set while a flock(2) lock may be held on fd (logged,
	// not migrated, by SaveState).
	flocked atomic.Bool
}

func (h *handle) tableID() uint64      { return h.id }
func (h *handle) setTableID(id uint64) { h.id = id }

func (h *handle) tryRef() bool { return tryRef(&h.refs) }

func (h *handle) put() {
	if h.refs.Add(-1) != 0 {
		return
	}
	if h.fd >= 0 {
		sysClose(h.fd)
		h.ino.fs.handleFDs.Add(-1)
	}
	h.ino.handles.Add(-1)
	if h.writer {
		h.ino.writers.Add(-1)
	}
	h.ino.put()
}

// dirStream is the getdents state of an open directory: the guest reads it
// in pieces, resuming at the d_off cookie of the last entry it received.
type dirStream struct {
	mu   sync.Mutex
	buf  []byte
	pos  int    // next unread byte in buf
	end  int    // bytes of entries in buf
	next uint64 // cookie of the first unread entry (the fd's position if pos == end)
	eof  bool
}

// getInode resolves a node id from the guest, takes a use reference and
// provides an O_PATH fd.
func (f *FS) getInode(id uint64) (iref, syscall.Errno) {
	i := f.node(id)
	if i == nil {
		return iref{}, syscall.EBADF
	}
	return f.pathOf(i)
}

// node returns the inode for a guest node id, without a reference.
func (f *FS) node(id uint64) *inode {
	if id == rootID {
		return f.root
	}
	return f.nodes.get(id)
}

// pathOf takes a use reference on i and provides an O_PATH fd for it. Every
// use of an inode's fd goes through here, so a stale inode answers ESTALE.
// A resident fd costs the reference's compare-and-swap alone; an evicted
// inode is reopened (budget.go).
func (f *FS) pathOf(i *inode) (iref, syscall.Errno) {
	if i.stale {
		return iref{}, syscall.ESTALE
	}
	fd, ok := i.acquire()
	if !ok {
		return iref{}, syscall.EBADF
	}
	if fd >= 0 {
		return iref{inode: i, fd: fd}, 0
	}
	if i.mnt == nil {
		return f.reopenEvicted(i)
	}
	fd, e := sysOpenByHandle(i.mnt.fd, i.key.handle, unix.O_PATH|unix.O_CLOEXEC)
	if e != 0 {
		i.put()
		return iref{}, e // ESTALE once the object is gone
	}
	owned := true
	if i.isDir() {
		fd, owned = f.cacheDirFD(i, fd)
	}
	return iref{inode: i, fd: fd, ownedFD: owned}, 0
}

// getDir is getInode for ids that must be directories.
func (f *FS) getDir(id uint64) (iref, syscall.Errno) {
	i := f.node(id)
	if i == nil {
		return iref{}, syscall.EBADF
	}
	if i.stale {
		return iref{}, syscall.ESTALE
	}
	if !i.isDir() {
		return iref{}, syscall.ENOTDIR
	}
	return f.pathOf(i)
}

// getHandle resolves a file handle from the guest and takes a use reference.
func (f *FS) getHandle(fh uint64, kind handleKind) (*handle, syscall.Errno) {
	h := f.handles.get(fh)
	if h == nil || h.kind != kind {
		return nil, syscall.EBADF
	}
	if h.stale {
		return nil, syscall.ESTALE
	}
	if !h.tryRef() {
		return nil, syscall.EBADF
	}
	return h, 0
}

// handleOf is getHandle for the optional handle of a request on inode i
// (GETATTR and STATX with FUSE_GETATTR_FH, SETATTR with FATTR_FH): nil
// without an error when fh is unknown or belongs to another inode.
func (f *FS) handleOf(fh uint64, i *inode) (*handle, syscall.Errno) {
	h := f.handles.get(fh)
	if h == nil || h.ino != i {
		return nil, 0
	}
	if h.stale {
		return nil, syscall.ESTALE
	}
	if !h.tryRef() {
		return nil, 0
	}
	return h, 0
}

// internOpened finds or creates the inode for the O_PATH fd whose statx is st and
// adds one guest lookup. It takes ownership of fd (closing it when the
// object is already known). The returned inode carries no use reference:
// the caller's lookup keeps it alive until the guest forgets it, and the
// caller only reads its immutable fields.
func (f *FS) internOpened(fd int, st *unix.Statx_t) (*inode, syscall.Errno) {
	var hb handleBuf
	key, errno := f.keyFor(fd, st, &hb) // key's handle is a view of hb
	if errno != 0 {
		sysClose(fd)
		f.inodeFDs.Add(-1)
		return nil, errno
	}
	return f.intern(fd, st, key)
}

// internKnown adds one guest lookup to the inode of key if the table has
// it.
func (f *FS) internKnown(key inodeKey) (*inode, bool) {
	ks := &f.keys[key.hash()%keyShards]
	ks.mu.Lock()
	defer ks.mu.Unlock()
	i := ks.get(key)
	if i != nil && !i.pinned {
		i.nlookup++
	}
	return i, i != nil
}

// errNeedFD is intern's answer for an object given without an fd
// (lookupByHandle) whose mount has no mount fd any more: the caller
// looks it up again by fd.
const errNeedFD = syscall.EAGAIN

// intern is internOpened for a key already made; fd may be -1 for an
// object that is not a directory on a mount held by handle.
func (f *FS) intern(fd int, st *unix.Statx_t, key inodeKey) (*inode, syscall.Errno) {
	ks := &f.keys[key.hash()%keyShards]
	ks.mu.Lock()
	if i := ks.get(key); i != nil {
		if !i.pinned {
			i.nlookup++
		}
		ks.mu.Unlock()
		if fd >= 0 {
			sysClose(fd)
			f.inodeFDs.Add(-1)
		}
		return i, 0
	}
	own := ownedKey(&key)
	i, errno := f.newInode(fd, st, own)
	if errno != 0 {
		ks.mu.Unlock()
		return nil, errno
	}
	if !f.nodes.insert(own.hash(), i) {
		ks.mu.Unlock()
		i.put()
		return nil, syscall.ENFILE
	}
	ks.add(i)
	ks.mu.Unlock()
	if i.mnt == nil {
		f.fdAdded()
	}
	return i, 0
}

// keyFor returns the key of the object behind O_PATH fd (whose statx is
// st); in file handle mode its handle is encoded into hb and the key's
// handle is a view of hb (ownedKey copies it).
func (f *FS) keyFor(fd int, st *unix.Statx_t, hb *handleBuf) (inodeKey, syscall.Errno) {
	key := keyOf(st)
	if !f.useHandles {
		return key, 0
	}
	handles, known := f.mountHandles(key.mntID)
	if !known && uint32(st.Mode)&unix.S_IFMT == unix.S_IFDIR {
		handles, known = f.decideMount(key.mntID, fd), true
	}
	if known && !handles {
		if f.opts.InodeFileHandles == FileHandlesMandatory {
			return key, syscall.EOPNOTSUPP
		}
		return key, 0
	}
	if e := hb.encode(fd); e != 0 {
		if f.opts.InodeFileHandles == FileHandlesMandatory {
			return key, e
		}
		return key, 0
	}
	key.handle = hb.view()
	return key, 0
}

// newInode makes the inode for O_PATH fd (key from keyFor) with one guest
// lookup and the table's reference, in no table yet. It takes ownership of
// fd, closing it on failure or when the inode is held by file handle.
func (f *FS) newInode(fd int, st *unix.Statx_t, key inodeKey) (*inode, syscall.Errno) {
	i := &inode{key: key, ftype: uint16(st.Mode & unix.S_IFMT), nlookup: 1, fs: f}
	if fd < 0 { // lookupByHandle: the mount must still have its fd
		if i.mnt = f.acquireMount(key.mntID, -1); i.mnt == nil {
			return nil, errNeedFD
		}
		i.ref.Store(1)
		return i, 0
	}
	if key.handle != "" {
		opath := -1
		if i.isDir() {
			opath = fd
		}
		if i.mnt = f.acquireMount(key.mntID, opath); i.mnt != nil {
			// Held by handle: the O_PATH fd goes, but for a directory's
			// the cache takes (dircache.go).
			f.inodeFDs.Add(-1)
			i.ref.Store(1)
			owned := true
			if i.isDir() {
				_, owned = f.cacheDirFD(i, fd)
			}
			if owned {
				sysClose(fd)
			}
			return i, 0
		} else if f.opts.InodeFileHandles == FileHandlesMandatory {
			sysClose(fd)
			f.inodeFDs.Add(-1)
			return nil, syscall.EOPNOTSUPP
		}
	}
	i.ref.Store(residentWord(fd) | 1)
	f.residentFDs.Add(1)
	if !f.fdHeld.Load() {
		f.fdHeld.Store(true)
	}
	return i, 0
}

// forget drops n guest lookups of i; at zero the inode leaves the tables.
func (f *FS) forget(i *inode, n uint64) {
	if i.pinned {
		return
	}
	ks := &f.keys[i.key.hash()%keyShards]
	ks.mu.Lock()
	if !ks.has(i) {
		ks.mu.Unlock()
		return // already gone
	}
	if n >= i.nlookup {
		i.nlookup = 0
	} else {
		i.nlookup -= n
	}
	if i.nlookup > 0 {
		ks.mu.Unlock()
		return
	}
	ks.remove(i)
	f.nodes.remove(i.id)
	ks.mu.Unlock()
	i.put() // the table's reference
}
