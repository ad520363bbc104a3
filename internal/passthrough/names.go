package passthrough

import (
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/passthrough/migstate"
)

// The guest's renames and removals keep the recorded names of fd-held
// inodes current (budget.go) once the budget has been reached: each takes
// namesMu for writing around its syscall, finds the inodes the daemon knows
// at the names it changes (a statx), and updates their records once the
// syscall succeeded. Below the budget they cost nothing but a read lock:
// the records they leave behind are checked, before their inode is first
// evicted, against its parent (checkRecord).

// namesRecorded reports whether some inode is held by fd, so that names
// matter: with file handles alone they are neither recorded nor tracked.
func (f *FS) namesRecorded() bool { return f.fdHeld.Load() }

// Tracking states (FS.track).
const (
	untracked uint32 = iota // below the budget so far
	checking                // tracked; startTracking checks the older records
	tracked                 // tracked, and evictions may run
)

// isTracking reports whether renames and removals are tracked.
func (f *FS) isTracking() bool { return f.track.Load() != untracked }

// startTracking turns the tracking of renames and removals on, for good,
// when the budget is first reached: once the untracked ones under way
// (holding namesMu for reading) are done, it checks every record made
// until then against its parent's fd (nothing has been evicted yet, so
// every parent's is resident: one statx per inode, once), and only then
// lets evictions run. The caller holds no lock.
func (f *FS) startTracking() {
	if !f.track.CompareAndSwap(untracked, checking) {
		return
	}
	f.namesMu.Lock()
	f.namesMu.Unlock()
	for idx := range f.nodes.span() {
		i := f.nodes.at(idx)
		if i == nil {
			continue
		}
		if nm := i.name.Load(); nm != nil && !nm.checked && i.tryRef() {
			f.checkRecord(i, nm)
			i.put()
		}
	}
	f.track.Store(tracked)
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

// checkRecord checks that the name recorded for i when nobody tracked
// renames (nm) still leads to it from its parent's resident fd, and marks
// the record checked; a record that no longer does goes (i is then
// nameless until a lookup names it again). false: i is not to be evicted
// now. The caller holds a use reference on i. startTracking checks the
// records of its time; the sweep, any made by a lookup racing with it.
func (f *FS) checkRecord(i *inode, nm *inodeName) bool {
	p := nm.parent
	pfd := f.rootFD()
	if p != f.root {
		fd, ok := p.acquire()
		if !ok {
			return false
		}
		defer p.put()
		if pfd = fd; pfd < 0 {
			return false // not resident: checked in a later sweep
		}
	}
	var cn cname
	var st unix.Statx_t
	if sysStatx(pfd, cn.setString(nm.name), unix.AT_SYMLINK_NOFOLLOW, statxMask, &st) != 0 ||
		uint32(st.Mode)&unix.S_IFMT != i.ftype || !keyOf(&st).sameObject(i.key) {
		i.name.CompareAndSwap(nm, nil)
		return false
	}
	return i.name.CompareAndSwap(nm, &inodeName{parent: p, name: nm.name, checked: true})
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
	i := ks.m[key]
	ks.mu.Unlock()
	if i == nil || i.fh != nil || i.pinned {
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
			dst.name.Store(&inodeName{parent: od.inode, name: string(oldName), checked: true})
		} else {
			dst.name.Store(nil)
		}
	}
	if src != nil {
		// Whatever name it had (a hard link's, a stale one), this one
		// is current.
		src.name.Store(&inodeName{parent: nd.inode, name: string(newName), checked: true})
	}
	return 0
}

// nameStaged records a parent and name for each staged inode held by fd
// (a migration's destination): its directory is the staged inode of its
// path's directory, or the root. The path is the record's, or for one
// reopened by file handle its /proc/self/fd link (a reopen verifies the
// object anyway). Then a migrated guest's inodes can be evicted too; one
// whose directory is not staged stays nameless (resident).
func (l *loader) nameStaged() {
	root, rootOK := l.f.rootLink()
	paths := make([]string, len(l.s.Inodes))
	byPath := map[string]*inode{"": l.f.root}
	for k := range l.s.Inodes {
		i := l.all[k]
		if i == nil || i.stale || i.pinned {
			continue
		}
		p, ok := l.rootPath(k)
		if !ok && rootOK && i.fh == nil {
			if link, lok := l.f.fdLink(i.residentFD()); lok {
				p, ok = relLink(link, root)
			}
		}
		if ok {
			paths[k], byPath[p] = p, i
		}
	}
	for k := range l.s.Inodes {
		r, i := &l.s.Inodes[k], l.all[k]
		if i == nil || i.stale || i.pinned || i.fh != nil {
			continue
		}
		var dir *inode
		rel := r.Path
		if p := paths[k]; p != "" {
			j := strings.LastIndexByte(p, '/')
			dir, rel = byPath[p[:max(j, 0)]], p[j+1:]
		} else if r.Loc == migstate.LocPath && !strings.Contains(rel, "/") {
			dir = l.f.root
			if r.Parent != rootID {
				dir = l.all[l.plan.Parent[k]]
			}
		}
		if dir != nil && dir.isDir() && !dir.stale && checkName([]byte(rel)) == 0 {
			i.name.Store(&inodeName{parent: dir, name: rel})
		}
	}
}

// rootPath is record k's path below the shared directory, if it has one.
func (l *loader) rootPath(k int) (string, bool) {
	r := &l.s.Inodes[k]
	switch {
	case r.RawPath != "":
		return r.RawPath, true
	case r.Loc == migstate.LocFullPath:
		return r.Path, true
	case r.Loc == migstate.LocPath && r.Parent == rootID:
		return r.Path, true
	}
	return "", false
}
