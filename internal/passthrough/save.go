package passthrough

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math"
	"slices"
	"strings"
	"unicode/utf8"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/passthrough/migstate"
)

// SaveState writes the state of the guest's session to w (the stream of
// package migstate): every inode the guest holds, with a way to reopen it,
// and every open handle, in the Rust virtiofsd's format, then our trailer
// carrying session (the FUSE server's record, opaque here). Call it with
// no request running (every ring stopped). Locks are not saved.
func (f *FS) SaveState(w io.Writer, session []byte) error {
	s := f.snapshot()
	s.Ours = true
	s.Session = session
	return migstate.Encode(w, s)
}

// rootRefcount is the Rust daemon's own count on its root node (libfuse's
// 2); its loader frees a root whose count drops to 0.
const rootRefcount = 2

// snapshot builds the records of the current tables.
func (f *FS) snapshot() *migstate.State {
	c := f.collected()
	s := &migstate.State{V2: true, NextInode: rootID + 1}
	f.sessionMu.Lock()
	mounted := f.initDone
	f.sessionMu.Unlock()
	if !mounted {
		// As the Rust daemon before INIT: no inodes, not even the root.
		return s
	}
	caps := f.caps.Load()
	s.Opts = migstate.Negotiated{
		Writeback:         f.writeback.Load(),
		AnnounceSubmounts: f.submounts.Load(),
		PosixACL:          caps&gofuse.CAP_POSIX_ACL != 0,
		SuppGroups:        caps&gofuse.CAP_CREATE_SUPP_GROUP != 0,
	}
	sv := newSaver(f, s, c)
	inodes, lockable := f.heldInodes()
	defer func() {
		for _, h := range inodes {
			h.i.put()
		}
	}()
	sv.addInodes(inodes)
	handles := holdAll(&f.handles)
	defer putAll(handles)
	slices.SortFunc(handles, func(a, b *handle) int { return cmpU64(a.id, b.id) })
	locked := sv.addHandles(handles)
	f.warnDroppedLocks(lockable, locked)
	return s
}

// heldInode is an inode the guest holds, with its lookup count at the save.
type heldInode struct {
	i       *inode
	nlookup uint64
}

// heldInodes takes a use reference on every inode the guest holds and
// returns them in id order, and every inode that may hold locks (those and
// the root).
func (f *FS) heldInodes() (inodes []heldInode, lockable []*inode) {
	lockable = []*inode{f.root}
	for si := range f.keys {
		ks := &f.keys[si]
		ks.mu.Lock()
		ks.each(func(i *inode) {
			if !i.pinned && i.tryRef() {
				inodes = append(inodes, heldInode{i, i.nlookup})
				lockable = append(lockable, i)
			}
		})
		ks.mu.Unlock()
	}
	slices.SortFunc(inodes, func(a, b heldInode) int { return cmpU64(a.i.id, b.i.id) })
	return inodes, lockable
}

// saver builds the records of one SaveState.
type saver struct {
	f *FS
	s *migstate.State
	// What the collection found, if one ran (nil maps otherwise).
	paths   map[*inode]string
	handles map[*inode]migstate.FileHandle
	// byHandle: file-handles mode; verify: find-paths with VerifyHandles.
	byHandle, verify bool
	onMount          map[uint64][]*inode // inodes sent by file handle, by mount
}

func newSaver(f *FS, s *migstate.State, c *collection) *saver {
	mo := &f.opts.Migration
	sv := &saver{f: f, s: s, byHandle: mo.Mode == MigrationFileHandles, onMount: map[uint64][]*inode{}}
	sv.verify = mo.VerifyHandles && !sv.byHandle
	if c != nil {
		sv.paths, sv.handles = c.paths, c.handles
	}
	return sv
}

// addInodes makes the root's record and one per inode: by file handle, by
// the path collected (confirmed with ConfirmPaths) or found now, else
// Invalid.
func (sv *saver) addInodes(inodes []heldInode) {
	s := sv.s
	s.Inodes = make([]migstate.Inode, 1, len(inodes)+1)
	s.Inodes[0] = migstate.Inode{ID: rootID, Refcount: rootRefcount, Loc: migstate.LocRoot, Type: unix.S_IFDIR}
	if sv.verify {
		if h, err := sv.f.handleRecordOf(sv.f.root); err == nil {
			s.Inodes[0].Verify = &h
		} else {
			sv.f.log.Warn("passthrough: migration: no file handle for the shared directory; the destination cannot verify it", "err", err)
		}
	}
	var need []*inode
	for _, h := range inodes {
		r, found := sv.record(h.i, h.nlookup)
		if !found {
			need = append(need, h.i)
		}
		s.Inodes = append(s.Inodes, r)
	}
	var found map[*inode]string
	if len(need) > 0 {
		found = sv.f.findPaths(need, nil)
	}
	for k := range inodes {
		sv.finish(&s.Inodes[1+k], inodes[k].i, found)
	}
	if sv.byHandle {
		s.MountPaths = sv.f.mountPaths(sv.onMount)
	}
}

// record makes i's record from what is at hand: its file handle in
// file-handles mode, else the path collected. found is false when it still
// needs a path.
func (sv *saver) record(i *inode, nlookup uint64) (r migstate.Inode, found bool) {
	r = migstate.Inode{ID: i.id, Refcount: nlookup, Type: uint32(i.ftype), Loc: migstate.LocInvalid}
	if i.stale {
		return r, true
	}
	if sv.byHandle {
		if fh, ok := sv.fileHandle(i, slog.LevelInfo, "passthrough: migration: no file handle for an inode, sending its path"); ok {
			r.Loc, r.Handle = migstate.LocFileHandle, fh
			sv.onMount[fh.MountID] = append(sv.onMount[fh.MountID], i)
		}
	}
	found = true
	if r.Loc == migstate.LocInvalid {
		if p, ok := sv.paths[i]; ok && (!sv.f.opts.Migration.ConfirmPaths || sv.f.verifyPath(p, i)) {
			r.Loc, r.Path = migstate.LocFullPath, p
		} else {
			found = false
		}
	}
	if sv.verify {
		if fh, ok := sv.fileHandle(i, slog.LevelWarn, "passthrough: migration: no file handle for an inode; the destination cannot verify it"); ok {
			r.Verify = &fh
		}
	}
	return r, found
}

// fileHandle returns i's file handle: the collected one, else
// name_to_handle_at's now. A failure is logged at level with msg.
func (sv *saver) fileHandle(i *inode, level slog.Level, msg string) (migstate.FileHandle, bool) {
	if fh, ok := sv.handles[i]; ok {
		return fh, true
	}
	fh, err := sv.f.handleRecordOf(i)
	if err != nil {
		sv.f.log.Log(context.Background(), level, msg, "node", i.id, "err", err)
		return fh, false
	}
	return fh, true
}

// finish gives record r of inode i the path found for it, if it had none,
// and the form its destination needs.
func (sv *saver) finish(r *migstate.Inode, i *inode, found map[*inode]string) {
	if r.Loc == migstate.LocInvalid && !i.stale {
		if p, ok := found[i]; ok {
			r.Loc, r.Path = migstate.LocFullPath, p
		}
	}
	switch {
	case r.Loc == migstate.LocFullPath && !utf8.ValidString(r.Path):
		// The Rust format's strings are UTF-8: our trailer carries the
		// path, a Rust destination finds the inode Invalid.
		r.Loc, r.RawPath, r.Path = migstate.LocInvalid, r.Path, ""
		sv.f.log.Warn("passthrough: migration: a path that is not UTF-8 travels in our trailer only; a Rust destination would find the inode invalid",
			"node", r.ID)
	case r.Loc == migstate.LocFullPath && sv.verify:
		// The 1.13 loader checks the file handle of a Path location,
		// not of a FullPath one.
		r.Loc, r.Parent = migstate.LocPath, rootID
		sv.s.Inodes[0].Refcount++
	case r.Loc == migstate.LocInvalid:
		sv.f.log.Warn("passthrough: migration: no path for an inode, sent as invalid",
			"node", r.ID, "type", fmt.Sprintf("%#o", r.Type), "stale", i.stale)
	}
	sv.s.NextInode = max(sv.s.NextInode, sv.f.nextID(r.ID))
}

// addHandles makes a record of each open handle (in id order) whose inode
// the guest still holds, and returns the inodes with a flock(2) lock.
func (sv *saver) addHandles(handles []*handle) (locked map[*inode]bool) {
	locked = map[*inode]bool{}
	for _, h := range handles {
		if h.flocked.Load() {
			locked[h.ino] = true
		}
		if h.ino != sv.f.root && sv.f.node(h.ino.id) != h.ino {
			// The guest forgot the inode of an open handle, so it
			// cannot use the handle any more.
			sv.f.log.Warn("passthrough: migration: handle of a forgotten inode not sent", "fh", h.id, "node", h.ino.id)
			continue
		}
		host := uint32(h.flags) &^ (unix.O_CREAT | unix.O_EXCL | unix.O_TRUNC | unix.O_CLOEXEC)
		rust := host &^ unix.O_APPEND
		dir := h.kind == handleDir
		if dir {
			rust = unix.O_RDONLY | unix.O_DIRECTORY
		}
		sv.s.Handles = append(sv.s.Handles, migstate.Handle{ID: h.id, Inode: h.ino.id, Flags: int32(rust),
			Known: true, Dir: dir, HostFlags: host})
		sv.s.NextHandle = max(sv.s.NextHandle, sv.f.nextID(h.id))
	}
	return locked
}

// warnDroppedLocks logs the locks held on lockable's inodes: they do not
// migrate.
func (f *FS) warnDroppedLocks(lockable []*inode, locked map[*inode]bool) {
	for _, i := range lockable {
		n := 0
		if l := i.locks.Load(); l != nil {
			l.mu.Lock()
			n = len(l.fds)
			l.mu.Unlock()
		}
		if n > 0 || locked[i] {
			f.log.Warn("passthrough: migration: locks on an inode are dropped (they do not migrate)",
				"node", i.id, "posix_lock_owners", n, "flock", locked[i])
		}
	}
}

// nextID is the Rust daemon's next id after id: above it, unless it is the
// largest (a foreign id restored here), which cannot be exceeded.
func (f *FS) nextID(id uint64) uint64 {
	if id == math.MaxUint64 {
		f.log.Warn("passthrough: migration: an id of 2^64-1 is in use; the Rust daemon's counter cannot go above it")
		return id
	}
	return id + 1
}

// mountPaths finds, for each mount the file handles of onMount's inodes
// are on, a path in the share on that mount, which a destination opens to
// open the handles with: "." for the share's own mount, else a verified
// path of one of its directories (or a file's directory). A mount without
// one is logged: its inodes will not open there.
func (f *FS) mountPaths(onMount map[uint64][]*inode) []migstate.MountPath {
	root, rootOK := f.rootLink()
	var out []migstate.MountPath
	for mnt, inodes := range onMount {
		if mnt == f.root.key.mntID {
			out = append(out, migstate.MountPath{MountID: mnt, Path: "."})
			continue
		}
		p, ok := "", false
		if rootOK {
			p, ok = f.mountPath(mnt, inodes, root)
		}
		if !ok {
			f.log.Warn("passthrough: migration: no path in the share for a mount; its inodes cannot be opened by a destination",
				"mount_id", mnt, "inodes", len(inodes))
			continue
		}
		out = append(out, migstate.MountPath{MountID: mnt, Path: p})
	}
	slices.SortFunc(out, func(a, b migstate.MountPath) int { return cmpU64(a.MountID, b.MountID) })
	return out
}

// mountPath finds the shortest path of a directory on mount mnt among
// inodes' (a directory's own path, or a file's directory), root being the
// share's /proc link.
func (f *FS) mountPath(mnt uint64, inodes []*inode, root string) (string, bool) {
	p, ok := "", false
	// Directories first: the shortest path is the likeliest mount point.
	slices.SortFunc(inodes, func(a, b *inode) int {
		return cmpBool(!a.isDir(), !b.isDir())
	})
	for _, i := range inodes {
		q, found := f.pathByLink(i, root)
		if !found {
			continue
		}
		if !i.isDir() {
			k := strings.LastIndexByte(q, '/')
			if k < 0 {
				continue
			}
			q = q[:k]
		}
		if f.onMount(q, mnt) && utf8.ValidString(q) && (!ok || len(q) < len(p)) {
			p, ok = q, true
		}
	}
	return p, ok
}

// onMount reports whether rel (a checked state path) opens as a directory
// on mount mnt.
func (f *FS) onMount(rel string, mnt uint64) bool {
	fd, e := f.openBeneath(rel)
	if e != 0 {
		return false
	}
	defer f.closeInodeFD(fd)
	var st unix.Statx_t
	return statxFD(fd, &st) == 0 && st.Mnt_id == mnt && uint32(st.Mode)&unix.S_IFMT == unix.S_IFDIR
}

// holdAll takes a use reference on every object of t not being torn down
// and returns them; putAll drops the references.
func holdAll[T any, P interface {
	*T
	tableID() uint64
	setTableID(uint64)
	tryRef() bool
}](t *slotTable[T, P]) []P {
	var held []P
	t.each(func(p P) {
		if p.tryRef() {
			held = append(held, p)
		}
	})
	return held
}

func putAll[P interface{ put() }](held []P) {
	for _, p := range held {
		p.put()
	}
}

func cmpBool(a, b bool) int {
	switch {
	case a == b:
		return 0
	case a:
		return 1
	}
	return -1
}

func cmpU64(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}
