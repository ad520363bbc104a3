package passthrough

import (
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// The names of fd-held inodes (budget.go) are recorded, and kept current
// by the guest's renames and removals, from the moment the budget is first
// reached: each rename or removal then takes namesMu for writing around
// its syscall, finds the inodes the daemon knows at the names it changes
// (a statx), and updates their records once the syscall succeeded. Below
// the budget nothing is recorded, and they cost nothing but a read lock.

// mayTrack reports whether some inode is held by fd, so that names may
// matter: with file handles alone they are neither recorded nor tracked.
func (f *FS) mayTrack() bool { return f.fdHeld.Load() }

// Tracking states (FS.track).
const (
	untracked  uint32 = iota // below the budget so far
	namingPass               // tracked; startTracking names the inodes held
	tracked                  // tracked, and evictions may run
)

// isTracking reports whether renames and removals are tracked.
func (f *FS) isTracking() bool { return f.track.Load() != untracked }

// startTracking turns the recording of names and the tracking of renames
// and removals on, for good, when the budget is first reached. In the
// background (naming is a readlink and a statx per inode held, about 8 µs
// each here: seconds for half a million), once the untracked renames and
// removals under way (holding namesMu for reading) are done, it names every
// inode held until then from its /proc/self/fd link (nothing has been
// evicted yet, so every one has its fd), and only then lets evictions run:
// meanwhile the budget is exceeded. The caller holds no lock.
func (f *FS) startTracking() {
	f.naming.Add(1) // before the state changes: shedFDs may wait on seeing it
	if !f.track.CompareAndSwap(untracked, namingPass) {
		f.naming.Done()
		return
	}
	pass := func() {
		defer f.naming.Done()
		f.namesMu.Lock()
		f.namesMu.Unlock()
		f.nameHeld()
		f.track.Store(tracked)
		f.overBudget() // what was added meanwhile
	}
	if f.nameInline {
		pass()
		return
	}
	go pass()
}

// nameHeld names every fd-held inode in the table that has no name yet
// from its /proc/self/fd link.
func (f *FS) nameHeld() {
	root, ok := f.rootLink()
	if !ok {
		return
	}
	for idx := range f.nodes.span() {
		if f.closing.Load() {
			return
		}
		if i := f.nodes.at(idx); i != nil && i.mnt == nil && !i.pinned && !i.stale && i.name.Load() == nil && i.tryRef() {
			if nm := f.nameByLink(i.residentFD(), root); nm != nil {
				i.name.CompareAndSwap(nil, nm)
			}
			i.put()
		}
	}
}

// nameByLink is the name of the object of fd (an inode's resident fd) in
// its directory, as its /proc/self/fd link says (root: the shared
// directory's link), the directory being the inode the daemon holds for
// it; nil when it has none (unlinked, moved out of the share, or its
// directory not held). A host-side change racing with it can only give a
// name that a reopen will not verify.
func (f *FS) nameByLink(fd int, root string) *inodeName {
	link, ok := f.fdLink(fd)
	if fd < 0 || !ok {
		return nil
	}
	rel, ok := relLink(link, root)
	if !ok {
		return nil
	}
	j := strings.LastIndexByte(rel, '/')
	name, dir := rel[j+1:], f.root
	if j >= 0 {
		p := make([]byte, j+1)
		copy(p, rel[:j])
		var st unix.Statx_t
		if sysStatx(f.rootFD(), &p[0], unix.AT_SYMLINK_NOFOLLOW, statxMask, &st) != 0 {
			return nil
		}
		key := keyOf(&st)
		ks := &f.keys[key.hash()%keyShards]
		ks.mu.Lock()
		dir = ks.get(key)
		ks.mu.Unlock()
	}
	if dir == nil || !dir.isDir() || dir.stale || checkName([]byte(name)) != 0 {
		return nil
	}
	return &inodeName{parent: dir, name: name}
}

// untracked runs op (a rename or removal) without tracking, holding
// namesMu for reading so that startTracking can wait for it; false when
// tracking is on and op did not run.
func (f *FS) untracked(op func() syscall.Errno) (syscall.Errno, bool) {
	f.namesMu.RLock()
	defer f.namesMu.RUnlock()
	if f.isTracking() {
		return 0, false
	}
	return op(), true
}

// recordIs reports whether i's recorded name is name in dir.
func recordIs(i, dir *inode, name []byte) bool {
	nm := i.name.Load()
	return nm != nil && nm.parent == dir && nm.name == string(name)
}

// childAt returns the fd-held inode the daemon knows for name in directory
// dirfd (no reference: the caller only updates its record), or nil.
func (f *FS) childAt(dirfd int, name *byte) *inode {
	var st unix.Statx_t
	if sysStatx(dirfd, name, unix.AT_SYMLINK_NOFOLLOW, statxMask, &st) != 0 {
		return nil
	}
	key := keyOf(&st)
	ks := &f.keys[key.hash()%keyShards]
	ks.mu.Lock()
	i := ks.get(key)
	ks.mu.Unlock()
	if i == nil || i.mnt != nil || i.pinned {
		return nil
	}
	return i
}

// keepResident holds i with a resident fd whatever the budget: i is about
// to lose its recorded name, after which it could not be reopened. The
// caller holds namesMu for writing.
func (f *FS) keepResident(i *inode) (iref, syscall.Errno) {
	fd, ok := i.acquire()
	if !ok {
		return iref{}, syscall.EBADF
	}
	if fd >= 0 {
		return iref{inode: i, fd: fd}, 0
	}
	return f.reopenHeld(i, true)
}

// removeTracked unlinks name in dir (flags: unlinkat's), making nameless
// the inode recorded there.
func (f *FS) removeTracked(dir iref, name []byte, p *byte, flags int) syscall.Errno {
	f.namesMu.Lock()
	defer f.namesMu.Unlock()
	victim := f.childAt(dir.fd, p)
	if victim != nil && recordIs(victim, dir.inode, name) {
		if keep, errno := f.keepResident(victim); errno == 0 {
			defer keep.put()
		}
	}
	errno := sysUnlinkat(dir.fd, p, flags)
	if errno == 0 && victim != nil && recordIs(victim, dir.inode, name) {
		victim.name.Store(nil)
	}
	return errno
}

// renameTracked renames on in od to nn in nd and moves the records: the
// source's to its new name, the target's to the old name (exchange) or
// to none (replaced).
func (f *FS) renameTracked(od, nd iref, oldName, newName []byte, op, np *byte, flags uint32) syscall.Errno {
	f.namesMu.Lock()
	defer f.namesMu.Unlock()
	src := f.childAt(od.fd, op)
	var dst *inode
	exchange := flags&unix.RENAME_EXCHANGE != 0
	if flags&unix.RENAME_NOREPLACE == 0 {
		dst = f.childAt(nd.fd, np)
		if dst == src {
			dst = nil // two names of one object: rename changes nothing
		}
	}
	if dst != nil && !exchange && recordIs(dst, nd.inode, newName) {
		if keep, errno := f.keepResident(dst); errno == 0 {
			defer keep.put()
		}
	}
	if errno := sysRenameat2(od.fd, op, nd.fd, np, flags); errno != 0 {
		return errno
	}
	if dst != nil && recordIs(dst, nd.inode, newName) {
		if exchange {
			dst.name.Store(&inodeName{parent: od.inode, name: string(oldName)})
		} else {
			dst.name.Store(nil)
		}
	}
	if src != nil {
		// Whatever name it had (a hard link's, a stale one), this one
		// is current.
		src.name.Store(&inodeName{parent: nd.inode, name: string(newName)})
	}
	return 0
}
