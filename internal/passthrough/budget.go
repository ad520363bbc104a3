package passthrough

import (
	"log/slog"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// The fd budget (Options.InodeFDBudget). An inode held by O_PATH fd
// (--inode-file-handles=never, or a file system without file handles) keeps
// its fd resident only while the daemon holds fewer than the budget: once
// the budget is reached, a clock sweep closes the fds of inodes nobody is
// using, and a request on such an evicted inode reopens it through what the
// daemon knows of it, its parent and its name. Below the budget nothing is
// evicted and nothing is reopened: the daemon behaves as without one.
//
// Policy. Never evicted: the root; an inode with a use reference beyond
// the table's and its open handles' (a request under way, a migration):
// an open file's requests use the handle's own fd, so its inode's O_PATH
// fd may go, or every open file would hold two fds; a nameless inode (its only recorded name was removed by the
// guest, an O_TMPFILE, or one reached by ".."), which could not be found
// again; a stale one. Everything else may be evicted, directories on the
// way to cached inodes included: a reopen walks down from the nearest
// ancestor whose fd is resident (the root at worst). Each request sets
// the inode's used bit; the sweep clears it and passes over the inode once
// (second chance), so recently used inodes and their directories stay.
// The sweep visits the table's slots only: the few inodes a migration
// restored under ids outside them (slotTable's overflow) stay resident.
//
// The fd and the use count share one word (refWord): a request takes its
// reference and learns the resident fd in the one compare-and-swap
// tryRef always did, and the sweep detaches an fd only by a
// compare-and-swap from "this fd, no reference but the table's": no
// request can be using it, and none can pick it up afterwards.
//
// Names. Once the budget is first reached (names.go), each fd-held inode
// records a parent (an *inode: the chain stays in memory) and a name: those
// held then, from their /proc/self/fd links, in one pass before anything
// is evicted; later ones from the lookup that found them (LOOKUP,
// READDIRPLUS, CREATE, MKDIR, MKNOD, SYMLINK, LINK: a lookup that finds a
// known inode under another name records the new one). From then on the
// guest's RENAME (exchange included), UNLINK and RMDIR keep them current
// (the recorded name removed: the inode becomes nameless, its fd made
// resident first): those requests take namesMu for writing around their
// syscall; a reopen takes it for reading, so it never sees a rename half
// done. Below the budget nothing is recorded: no allocation, no system
// call. Host-side changes are not seen: a reopen then finds nothing, or
// another object, and answers ESTALE.
//
// Reopen. One component at a time from the nearest resident ancestor
// (openChild: O_PATH|O_NOFOLLOW, openat2 RESOLVE_BENEATH|NO_SYMLINKS|
// NO_MAGICLINKS where available), never following a symlink, each
// component checked to be the recorded object (sameObject): its mount
// and type, and its AT_HANDLE_FID handle where the file system gives one
// (overlayfs may change a non-directory's st_ino at copy-up), else its
// device and inode number. Gone, replaced or not a directory on the way:
// ESTALE, as a network file system answers.

// refWord layout: bits 0-30 the use count, bit 31 the used bit (set by
// every acquire, cleared by the sweep), bits 32-63 the resident fd + 1
// (0: none).
const (
	refCountMask uint64 = 1<<31 - 1
	refUsed      uint64 = 1 << 31
	refFDShift          = 32
	refFDMask    uint64 = 0xffffffff << refFDShift
)

func wordCount(w uint64) uint64 { return w & refCountMask }

// wordFD is the resident fd of w, -1 for none.
func wordFD(w uint64) int { return int(w>>refFDShift) - 1 }

func residentWord(fd int) uint64 { return uint64(fd+1) << refFDShift }

// acquire takes a use reference, marks the inode used, and returns its
// resident fd (-1: none); false when the inode is being torn down.
func (i *inode) acquire() (int, bool) {
	for {
		w := i.ref.Load()
		if n := wordCount(w); n == 0 || n == refCountMask {
			return -1, false
		}
		if i.ref.CompareAndSwap(w, (w+1)|refUsed) {
			return wordFD(w), true
		}
	}
}

// residentFD is the inode's resident fd (-1: none). Only the root's, which
// is never evicted, is read without a reference.
func (i *inode) residentFD() int { return wordFD(i.ref.Load()) }

// install makes fd the inode's resident fd unless another request did
// first; it returns the resident fd. The caller holds a use reference.
func (i *inode) install(fd int) (int, bool) {
	for {
		w := i.ref.Load()
		if cur := wordFD(w); cur >= 0 {
			return cur, false
		}
		if i.ref.CompareAndSwap(w, w|residentWord(fd)) {
			return fd, true
		}
	}
}

// inodeName is where the daemon last saw an object: name in parent.
// Immutable; replaced whole.
type inodeName struct {
	parent *inode
	name   string
}

// fdBudgetMin is the smallest budget accepted: a reopen walk holds at most
// two fds at a time, so any budget works, but below this one nearly every
// request reopens.
const fdBudgetMin = 16

// defaultFDBudget is the budget for a daemon whose RLIMIT_NOFILE is
// nofile: half of it, leaving the other half to open files and
// directories, lock owners, the vhost-user connection and reopen walks.
func defaultFDBudget(nofile uint64) int {
	return int(max(min(nofile/2, 1<<30), fdBudgetMin))
}

// fdBudget is the budget the options ask for, the default from the
// current RLIMIT_NOFILE when they give none.
func fdBudget(o *Options) int64 {
	if o.InodeFDBudget > 0 {
		return int64(max(o.InodeFDBudget, fdBudgetMin))
	}
	var rl unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &rl) != nil {
		return 1 << 30
	}
	return int64(defaultFDBudget(rl.Cur))
}

// overBudget evicts when the resident fds have reached the budget, unless
// the last sweep found too little to evict and the resident fds have not
// grown by a batch since (inodes with open handles alone can fill the
// budget: a sweep per request would then scan the table in vain).
func (f *FS) overBudget() {
	r := f.residentFDs.Load()
	if r < f.budget {
		if f.sweepAgainAt.Load() != 0 {
			f.sweepAgainAt.Store(0)
		}
		return
	}
	if r >= f.sweepAgainAt.Load() {
		f.evictSome()
	}
}

// fdAdded is overBudget for intern, which holds no lock: the first time
// the budget is reached, the tracking of names starts.
func (f *FS) fdAdded() {
	if f.track.Load() == untracked && f.residentFDs.Load() >= f.budget {
		f.startTracking()
	}
	f.overBudget()
}

// evictSome sweeps the node table from the clock hand, evicting until the
// resident fds are down to the budget less 1/16. One sweep at a time: a
// request finding one under way goes on (the budget is then exceeded by
// at most the requests running).
func (f *FS) evictSome() {
	if f.track.Load() != tracked || !f.evictMu.TryLock() {
		return
	}
	defer f.evictMu.Unlock()
	if !f.budgetWarned {
		f.budgetWarned = true
		f.log.Warn("passthrough: inode fd budget reached: fds of unused inodes are closed and reopened by name when needed; a host-side rename, replace or unlink of such an inode then answers ESTALE to the guest (--inode-fd-budget, or file handles, avoid it)",
			"budget", f.budget)
	}
	batch := max(f.budget/16, 1)
	target := f.budget - batch
	if r := f.sweepTo(target); r > target {
		f.sweepAgainAt.Store(r + batch)
	} else {
		f.sweepAgainAt.Store(0)
	}
}

// sweepTo runs the clock until the resident fds are down to target or
// every inode was passed twice, and returns the resident fds left. The
// caller holds evictMu.
func (f *FS) sweepTo(target int64) int64 {
	span := f.nodes.span()
	for n := uint32(0); n < 2*span && f.residentFDs.Load() > target; n++ {
		if f.hand >= span {
			f.hand = 0
		}
		i := f.nodes.at(f.hand)
		f.hand++
		if i != nil {
			f.tryEvict(i)
		}
	}
	return f.residentFDs.Load()
}

// outOfFDs is what an open that failed with e does before it answers: for
// want of fds (EMFILE, ENFILE: the open files, lock owners and the rest
// have taken the other half of RLIMIT_NOFILE, or the host's file table is
// full) it sheds inode fds and reports whether one more try is worth it;
// the caller logs (warnFDLimit) if that one fails too. wait: the caller
// holds no namesMu, so shedFDs may wait for the naming pass.
func (f *FS) outOfFDs(e syscall.Errno, wait bool) bool {
	if e != syscall.EMFILE && e != syscall.ENFILE {
		return false
	}
	if f.shedFDs(wait) {
		return true
	}
	f.warnFDLimit(e)
	return false
}

// withFDs runs open, and once more after shedding inode fds when it
// failed for want of them (outOfFDs; wait as there); a failure the guest
// then sees is logged once.
func (f *FS) withFDs(wait bool, open func() (int, syscall.Errno)) (int, syscall.Errno) {
	fd, e := open()
	if e != 0 && f.outOfFDs(e, wait) {
		if fd, e = open(); e != 0 {
			f.warnFDLimit(e)
		}
	}
	return fd, e
}

// shedFDs evicts a batch (a sixteenth of the budget) of resident inode
// fds, under the budget or not, and reports whether it freed any. Names
// are needed for that: if the budget was never reached it starts their
// tracking, and with wait it waits for the naming pass (about 8 µs per
// inode held); a caller holding namesMu must not (the pass takes it) and
// sheds nothing until the pass is done.
func (f *FS) shedFDs(wait bool) bool {
	if !f.mayTrack() {
		return false
	}
	if f.track.Load() != tracked {
		f.startTracking()
		if !wait {
			return false
		}
		f.naming.Wait()
		if f.track.Load() != tracked {
			return false // the file system is closing
		}
	}
	f.evictMu.Lock()
	defer f.evictMu.Unlock()
	r := f.residentFDs.Load()
	return f.sweepTo(r-max(f.budget/16, 1)) < r
}

// tryEvict closes i's resident fd if policy allows it and nothing uses it;
// a used inode only loses its used bit. The caller holds evictMu.
func (f *FS) tryEvict(i *inode) {
	if i.pinned || i.stale || i.mnt != nil || i.name.Load() == nil {
		return
	}
	// The word first, then the handles: a handle counts itself after
	// taking its reference and uncounts itself before dropping it, so a
	// count of the table's reference plus the handles read after the
	// word, in a word unchanged until the compare-and-swap, leaves no
	// request using the fd.
	w := i.ref.Load()
	idle := 1 + uint64(max(i.handles.Load(), 0))
	if wordFD(w) < 0 || wordCount(w) != idle {
		return
	}
	if w&refUsed != 0 {
		i.ref.CompareAndSwap(w, w&^refUsed)
		return
	}
	// A reference of the sweep's own keeps the fd open while its FID is
	// read; the eviction then needs the count to be exactly the table's,
	// the handles' and the sweep's.
	if !i.ref.CompareAndSwap(w, w+1) {
		return
	}
	fd := wordFD(w)
	f.recordFID(i, fd)
	if !i.ref.CompareAndSwap(w+1, (w+1)&^refFDMask) {
		i.put()
		return
	}
	f.residentFDs.Add(-1)
	f.evictedNow.Add(1)
	f.closeInodeFD(fd)
	i.put()
}

// atHandleFID is AT_HANDLE_FID (include/uapi/linux/fcntl.h, Linux 6.5),
// not in x/sys yet: name_to_handle_at then returns a handle that
// identifies the object but need not be decodable, which overlayfs gives
// without nfs_export.
const atHandleFID = 0x200

// recordFID stores the AT_HANDLE_FID identity of i (fd is its resident fd)
// if the file system gives one. The caller holds evictMu.
func (f *FS) recordFID(i *inode, fd int) {
	if i.fid.Load() != nil || f.noFID[i.key.mntID] {
		return
	}
	var b handleBuf
	if _, e := b.encodeAt(fd, atHandleFID); e != 0 {
		if f.noFID == nil {
			f.noFID = make(map[uint64]bool)
		}
		f.noFID[i.key.mntID] = true // EINVAL before 6.5, EOPNOTSUPP
		return
	}
	k := strings.Clone(b.view())
	i.fid.Store(&k)
}

// sameObject reports whether O_PATH fd is x's object: by its FID handle
// and mount when x has one recorded (one system call: name_to_handle_at
// reports the mount id statx does, and a handle names one object of its
// file system, whose type never changes), else by the same mount, type,
// device and inode number.
func (f *FS) sameObject(fd int, x *inode) bool {
	if fid := x.fid.Load(); fid != nil {
		var b handleBuf
		mnt, e := b.encodeAt(fd, atHandleFID)
		return e == 0 && uint64(mnt) == x.key.mntID && b.view() == *fid
	}
	var st unix.Statx_t
	return statxFD(fd, &st) == 0 && uint16(st.Mode&unix.S_IFMT) == x.ftype && keyOf(&st).sameObject(x.key)
}

// maxWalk bounds a reopen walk (a name chain is a tree path, but the bound
// costs nothing).
const maxWalk = 4096

// reopenEvicted reopens i, which the caller holds (a use reference) and
// which has no resident fd, and keeps the fd resident if the budget allows.
// The reference is dropped on failure.
func (f *FS) reopenEvicted(i *inode) (iref, syscall.Errno) {
	f.namesMu.RLock()
	r, errno := f.reopenHeld(i, false)
	f.namesMu.RUnlock()
	return r, errno
}

// reopenHeld is reopenEvicted for a caller holding namesMu; force keeps the
// fd resident whatever the budget (an inode about to become nameless).
func (f *FS) reopenHeld(i *inode, force bool) (iref, syscall.Errno) {
	fd, errno := f.reach(i, 0)
	if errno != 0 {
		i.put()
		return iref{}, errno
	}
	f.reopens.Add(1)
	fd, owned := f.settle(i, fd, force)
	return iref{inode: i, fd: fd, ownedFD: owned}, 0
}

// settle decides what becomes of fd, just reopened for x (held by the
// caller): x's resident fd when under budget (or forced), else the
// request's own. It returns the fd to use and whether the request owns it.
func (f *FS) settle(x *inode, fd int, force bool) (int, bool) {
	if !force {
		f.overBudget()
		if f.residentFDs.Load() >= f.budget {
			return fd, true
		}
	}
	cur, ok := x.install(fd)
	if !ok {
		f.closeInodeFD(fd) // another request reopened it meanwhile
		return cur, false
	}
	f.residentFDs.Add(1)
	f.evictedNow.Add(-1)
	return fd, false
}

// reach opens x's object through its recorded name as an O_PATH fd counted
// in inodeFDs, checked to be x's object. The caller holds namesMu.
func (f *FS) reach(x *inode, depth int) (int, syscall.Errno) {
	nm := x.name.Load()
	if nm == nil || depth > maxWalk {
		f.estales.Add(1)
		return -1, syscall.ESTALE
	}
	dir, errno := f.walkDir(nm.parent, depth+1)
	if errno != 0 {
		return -1, errno
	}
	var cn cname
	p := cn.setString(nm.name)
	fd, errno := f.withFDs(false, func() (int, syscall.Errno) { return f.openChildOnce(dir.fd, p) })
	dir.release()
	switch errno {
	case 0:
	case syscall.ENOENT, syscall.ENOTDIR, syscall.ELOOP, syscall.EXDEV:
		f.estales.Add(1)
		return -1, syscall.ESTALE // gone, or a symlink or file on the way
	default:
		return -1, errno
	}
	if !f.sameObject(fd, x) {
		f.closeInodeFD(fd)
		f.estales.Add(1)
		return -1, syscall.ESTALE // another object in its place
	}
	return fd, 0
}

// walkFD is a directory's fd on a reopen walk, with what releases it.
type walkFD struct {
	fs    *FS
	fd    int
	held  *inode // a use reference to drop, or nil
	owned bool   // fd is the walk's to close
}

func (w walkFD) release() {
	if w.owned {
		w.fs.closeInodeFD(w.fd)
	}
	if w.held != nil {
		w.held.put()
	}
}

// walkDir provides an fd of d, an ancestor on a reopen walk: the root's,
// d's resident one, or d reopened from its own record (and kept resident
// if the budget allows). The caller holds namesMu.
func (f *FS) walkDir(d *inode, depth int) (walkFD, syscall.Errno) {
	if d == f.root {
		return walkFD{fs: f, fd: f.root.residentFD()}, 0
	}
	if d.stale || !d.isDir() {
		f.estales.Add(1)
		return walkFD{}, syscall.ESTALE
	}
	if d.mnt != nil {
		r, errno := f.pathOf(d)
		if errno != 0 {
			return walkFD{}, errno
		}
		return walkFD{fs: f, fd: r.fd, held: d, owned: r.ownedFD}, 0
	}
	fd, ok := d.acquire()
	if !ok {
		// Forgotten by the guest while a child is held: walk through
		// its record without keeping anything.
		fd, errno := f.reach(d, depth)
		if errno != 0 {
			return walkFD{}, errno
		}
		return walkFD{fs: f, fd: fd, owned: true}, 0
	}
	if fd >= 0 {
		return walkFD{fs: f, fd: fd, held: d}, 0
	}
	fd, errno := f.reach(d, depth)
	if errno != 0 {
		d.put()
		return walkFD{}, errno
	}
	f.reopens.Add(1)
	fd, owned := f.settle(d, fd, false)
	return walkFD{fs: f, fd: fd, held: d, owned: owned}, 0
}

// noteName records name in dir as where i was found (a lookup), once the
// budget has been reached (below it, names are not recorded); a known
// inode found under its recorded name costs one atomic load and a compare.
func (f *FS) noteName(i, dir *inode, name []byte) {
	if !f.isTracking() || i.mnt != nil || i.pinned || i.stale || dir == nil {
		return
	}
	nm := i.name.Load()
	if nm != nil && nm.parent == dir && nm.name == string(name) {
		return
	}
	rec := &inodeName{parent: dir, name: string(name)}
	if nm == nil && i.name.CompareAndSwap(nil, rec) {
		return // a new inode: no reopen can be reading its record
	}
	f.namesMu.Lock()
	i.name.Store(rec)
	f.namesMu.Unlock()
}

// warnFDLimit logs, once, an open that failed for want of fds.
func (f *FS) warnFDLimit(e syscall.Errno) {
	if (e == syscall.EMFILE || e == syscall.ENFILE) && f.fdLimitWarned.CompareAndSwap(false, true) {
		f.log.Warn("passthrough: out of file descriptors: the guest sees "+e.Error()+"; lower --inode-fd-budget, raise --rlimit-nofile (or fs.file-max), or use --inode-file-handles",
			slog.Int64("inode_fds", f.inodeFDs.Load()), slog.Int64("handle_fds", f.handleFDs.Load()), slog.Int64("budget", f.budget))
	}
}

// rootFD is the shared directory's O_PATH fd (the root is never evicted).
func (f *FS) rootFD() int { return f.root.residentFD() }
