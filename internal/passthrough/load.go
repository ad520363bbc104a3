package passthrough

import (
	"bytes"
	"fmt"
	"io"
	"slices"
	"syscall"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
	"github.com/govirtiofsd/govirtiofsd/internal/passthrough/migstate"
)

// Destination: LoadState decodes the whole stream, validates it, opens every
// inode by its path beneath the shared directory or below its parent (never
// following a symlink, never leaving the share), or by its file handle
// (open_by_handle_at, which needs CAP_DAC_READ_SEARCH) on a mount it opens
// by path, checked to be an object inside the share (inside.go), and every
// handle from its inode as OPEN does, and only then
// replaces its tables, at the very same ids. An inode that cannot be opened
// (or, given a reference file handle, opens as another object) fails the
// load (MigrationAbort) or is installed stale (MigrationGuestError). Locks
// do not travel.

// LoadState reads a state from r, to end of stream: one this daemon or the
// Rust virtiofsd wrote (package migstate). It decodes and validates the
// whole stream, then calls restore with the FUSE server's session record
// the stream carried (nil for a stream without our trailer, i.e. from the
// Rust daemon), whether the guest had a session (the state has a root), and
// the negotiated options of the Rust format as gofuse.CAP_* bits
// (WRITEBACK_CACHE, SUBMOUNTS, POSIX_ACL with DONT_MASK and SETXATTR_EXT,
// CREATE_SUPP_GROUP). restore returns the capabilities of the session to
// install, as Init(caps) would, or an error. Then LoadState reopens every
// inode and handle and replaces whatever the FS held; without a session it
// ends the FS's, as Destroy does. On error nothing is installed and every fd
// opened meanwhile is closed. Call it with no request running.
func (f *FS) LoadState(r io.Reader, restore func(session []byte, mounted bool, negotiated uint64) (caps uint64, err error)) error {
	s, err := migstate.Decode(r, migstate.MaxSize)
	if err != nil {
		return err
	}
	plan, err := s.Validate()
	if err != nil {
		return fmt.Errorf("passthrough migration state: %w", err)
	}
	if err := f.checkNegotiated(s); err != nil {
		return err
	}
	var session []byte
	if s.Ours {
		session = s.Session
		if session == nil {
			session = []byte{}
		}
	}
	mounted := plan.Root >= 0
	caps, err := restore(session, mounted, negotiatedCaps(s.Opts))
	if err != nil {
		return err
	}
	if !mounted {
		f.stopCollecting(true)
		f.sessionMu.Lock()
		defer f.sessionMu.Unlock()
		f.reset()
		f.initDone = false
		return nil
	}
	st, err := f.stage(s, plan, caps)
	if err != nil {
		return err
	}
	return f.install(st, caps)
}

// negotiatedCaps is the negotiated options as the capabilities that turn
// them on.
func negotiatedCaps(o migstate.Negotiated) uint64 {
	c := optionCaps(o.Writeback, o.PosixACL, o.AnnounceSubmounts)
	if o.SuppGroups {
		c |= gofuse.CAP_CREATE_SUPP_GROUP
	}
	return c
}

// checkNegotiated refuses, as the Rust daemon does, a state whose source
// had writeback, announce_submounts or POSIX ACLs on when they are off
// here: the guest relies on them and would send no new INIT to learn
// otherwise. (A Rust source's --security-label is not in its stream: the
// session rebuilt for it assumes the destination's, fuse/state.go.)
func (f *FS) checkNegotiated(s *migstate.State) error {
	o := &f.opts
	switch {
	case s.Opts.Writeback && !o.Writeback:
		return fmt.Errorf("the migration source has the writeback cache on; it is off here (--writeback)")
	case s.Opts.AnnounceSubmounts && !o.AnnounceSubmounts:
		return fmt.Errorf("the migration source announces submounts; that is off here (--no-announce-submounts)")
	case s.Opts.PosixACL && !o.PosixACL:
		return fmt.Errorf("the migration source has POSIX ACLs on; they are off here (--posix-acl)")
	}
	return nil
}

// staged holds reopened objects not yet in any table; each carries the
// reference the table will own. paths are inodes only needed to open their
// children (the guest holds no lookup on them): released after staging.
type staged struct {
	inodes  []*inode
	handles []*handle
	paths   []*inode
}

func (st *staged) release() {
	for _, h := range st.handles {
		h.put()
	}
	for _, i := range st.inodes {
		i.put()
	}
	for _, i := range st.paths {
		i.put()
	}
	st.handles, st.inodes, st.paths = nil, nil, nil
}

// loader reopens the records of one LoadState.
type loader struct {
	f         *FS
	s         *migstate.State
	plan      *migstate.Plan
	mounts    *mountFDs
	abort     bool // Options.Migration.OnError is MigrationAbort
	writeback bool // the session to install has the writeback cache
	st        *staged
	all       []*inode            // per record, its inode once staged
	keys      map[inodeKey]uint64 // the objects staged, and the root: their node ids
	inside    insideCheck         // file handles: directories found inside the share
	pending   []pendingObject     // file handles: non-directories not yet found inside
}

// stage reopens every record. Unreachable objects follow
// Options.Migration.OnError.
func (f *FS) stage(s *migstate.State, plan *migstate.Plan, caps uint64) (_ *staged, err error) {
	l := &loader{
		f:         f,
		s:         s,
		plan:      plan,
		mounts:    &mountFDs{f: f, paths: s.MountPaths},
		abort:     f.opts.Migration.OnError == MigrationAbort,
		writeback: caps&gofuse.CAP_WRITEBACK_CACHE != 0,
		st:        &staged{inodes: make([]*inode, 0, len(s.Inodes)), handles: make([]*handle, 0, len(s.Handles))},
		all:       make([]*inode, len(s.Inodes)),
		keys:      make(map[inodeKey]uint64, len(s.Inodes)+1),
		inside:    insideCheck{f: f, dirs: map[objKey]bool{}},
	}
	defer l.mounts.close()
	defer func() {
		if err != nil {
			l.releasePending(0)
			l.st.release()
		}
	}()
	if r := &s.Inodes[plan.Root]; r.Verify != nil {
		// Another shared directory than the source's is a
		// configuration error, whatever OnError says.
		if why := f.sameHandle(f.root, r.Verify); why != "" {
			return nil, fmt.Errorf("migration: the shared directory is not the source's: %s", why)
		}
	}
	l.keys[f.root.key] = rootID
	for _, k := range plan.Order {
		if err := l.stageInode(k); err != nil {
			return nil, err
		}
	}
	if err := l.stagePending(); err != nil {
		return nil, err
	}
	for k := range s.Handles {
		if err := l.stageHandle(&s.Handles[k]); err != nil {
			return nil, err
		}
	}
	// The inodes only their children needed go now.
	for _, i := range l.st.paths {
		i.put()
	}
	l.st.paths = nil
	return l.st, nil
}

// stageInode reopens record k, or makes it a stale inode when OnError
// allows. A non-directory opened by file handle waits in pending until it
// is found inside the share (inside.go).
func (l *loader) stageInode(k int32) error {
	i, why, e := l.reopenInode(k)
	if i != nil && l.s.Inodes[k].Loc == migstate.LocFileHandle && l.s.Inodes[k].RawPath == "" &&
		!i.isDir() && !l.f.unlinkedFile(i) {
		l.pending = append(l.pending, pendingObject{k: k, i: i})
		return nil
	}
	return l.place(k, i, why, e)
}

// stagePending looks for the pending non-directories in the directories
// of the share known so far, and places each: found, or refused.
func (l *loader) stagePending() error {
	if len(l.pending) == 0 {
		return nil
	}
	dirs := []*inode{l.f.root}
	for _, i := range l.all { // with those only on their children's paths
		if i != nil && !i.stale && i.isDir() {
			dirs = append(dirs, i)
		}
	}
	l.inside.findNames(l.pending, dirs)
	for n := range l.pending {
		p := &l.pending[n]
		i, why := p.i, ""
		if !p.found {
			i.put()
			i, why = nil, "the file handle opens an object found in no directory of the shared directory"
		}
		p.i = nil
		if err := l.place(p.k, i, why, 0); err != nil {
			l.releasePending(n + 1)
			return err
		}
	}
	l.pending = nil
	return nil
}

// releasePending drops the pending objects from index n on (a load that
// fails).
func (l *loader) releasePending(n int) {
	for _, p := range l.pending[n:] {
		if p.i != nil {
			p.i.put()
		}
	}
	l.pending = nil
}

// place stages record k's inode i (nil: why it did not open, with errno
// e), checked against the source's reference handle and the objects
// staged already, or a stale inode when OnError allows.
func (l *loader) place(k int32, i *inode, why string, e syscall.Errno) error {
	r := &l.s.Inodes[k]
	if outOfResources(e) {
		if i != nil {
			i.put()
		}
		return fmt.Errorf("migration: node %#x (%s): %s", r.ID, r.Where(), why)
	}
	if i != nil && r.Verify != nil {
		if why = l.f.sameHandle(i, r.Verify); why != "" {
			i.put()
			i = nil
		}
	}
	lookups := l.plan.Lookups[k]
	if i != nil && lookups > 0 {
		if other, dup := l.keys[i.key]; dup {
			i.put()
			i, why = nil, fmt.Sprintf("opens as the object of node %#x", other)
		}
	}
	if i == nil {
		if lookups == 0 {
			// Only on its children's paths: they will say.
			return nil
		}
		if l.abort {
			return fmt.Errorf("migration: node %#x (%s): %s", r.ID, r.Where(), why)
		}
		l.f.log.Warn("passthrough: migration: inode restored stale", "node", r.ID, "location", r.Where(), "why", why)
		i = &inode{key: inodeKey{dev: staleDev, ino: r.ID}, ftype: uint16(r.Type), stale: true, fs: l.f}
		i.ref.Store(1)
	}
	i.id, i.nlookup = r.ID, lookups
	l.all[k] = i
	if lookups == 0 {
		l.st.paths = append(l.st.paths, i)
		return nil
	}
	l.keys[i.key] = r.ID
	l.st.inodes = append(l.st.inodes, i)
	return nil
}

// stageHandle reopens handle record r on its staged inode, or makes it
// stale when OnError allows.
func (l *loader) stageHandle(r *migstate.Handle) error {
	i := l.f.root
	if r.Inode != rootID {
		i = l.all[l.plan.Index[r.Inode]] // Validate: present, with lookups, so staged
	}
	dir := r.IsDir()
	h := &handle{id: r.ID, fd: -1, ino: i, flags: int(r.OpenFlags()), wait: bufvec.MayWait}
	if dir {
		h.kind, h.dir, h.flags = handleDir, &dirStream{}, unix.O_RDONLY
	}
	var why string
	switch {
	case i.stale:
		why = "its inode is stale"
	case dir && !i.isDir():
		why = fmt.Sprintf("a directory handle on an object of type %#o", i.ftype)
	case !dir && !i.isReg() && !i.isDir():
		why = fmt.Sprintf("a file handle on an object of type %#o", i.ftype)
	default:
		var e syscall.Errno
		h.fd, h.flags, why, e = l.f.reopenHandle(i, dir, r.OpenFlags(), l.writeback)
		if outOfResources(e) {
			return fmt.Errorf("migration: handle %#x of node %#x: %s", r.ID, r.Inode, why)
		}
	}
	if h.fd < 0 {
		if l.abort {
			return fmt.Errorf("migration: handle %#x of node %#x: %s", r.ID, r.Inode, why)
		}
		if !i.stale {
			l.f.log.Warn("passthrough: migration: handle restored stale", "fh", r.ID, "node", r.Inode, "why", why)
		}
		h.stale = true
	} else {
		l.f.handleFDs.Add(1)
		if !dir {
			h.wait = i.fileWait(h.fd)
		}
	}
	i.ref.Add(1) // the handle's reference
	i.handles.Add(1)
	h.countWriter()
	h.refs.Store(1)
	l.st.handles = append(l.st.handles, h)
	return nil
}

// outOfResources tells the errors of this daemon's limits (fds, memory)
// from those of the object: they fail a load whatever OnError says, since
// the object itself may be fine.
func outOfResources(e syscall.Errno) bool {
	return e == syscall.EMFILE || e == syscall.ENFILE || e == syscall.ENOMEM
}

// reopenInode opens record k as its location says and makes an inode of it
// (nil, why not and the errno when it does not open, or opens as another
// type than the trailer says).
func (l *loader) reopenInode(k int32) (*inode, string, syscall.Errno) {
	r := &l.s.Inodes[k]
	fd, why, e := l.openLocation(k)
	if fd < 0 {
		return nil, why, e
	}
	f := l.f
	var sx unix.Statx_t
	if e := statxFD(fd, &sx); e != 0 {
		f.closeInodeFD(fd)
		return nil, "statx: " + e.Error(), e
	}
	if t := uint32(sx.Mode) & unix.S_IFMT; r.Type != 0 && t != r.Type {
		f.closeInodeFD(fd)
		return nil, fmt.Sprintf("type %#o, saved as %#o", t, r.Type), 0
	}
	var hb handleBuf
	key, e := f.keyFor(fd, &sx, &hb)
	if e != 0 {
		f.closeInodeFD(fd)
		return nil, "file handle: " + e.Error(), e
	}
	i, e := f.newInode(fd, &sx, ownedKey(&key))
	if e != 0 {
		return nil, "file handle: " + e.Error(), e
	}
	return i, "", 0
}

// openLocation opens record k's object as an O_PATH fd (counted in
// inodeFDs): by its path below the share or below its staged parent, or by
// its file handle. It returns -1, why not and the errno when it cannot.
func (l *loader) openLocation(k int32) (int, string, syscall.Errno) {
	r, f := &l.s.Inodes[k], l.f
	var fd int
	var e syscall.Errno
	switch {
	case r.RawPath != "":
		fd, e = f.openBeneath(r.RawPath)
	case r.Loc == migstate.LocFullPath:
		fd, e = f.openBeneath(r.Path)
	case r.Loc == migstate.LocPath:
		parent := f.root
		if r.Parent != rootID {
			parent = l.all[l.plan.Parent[k]]
		}
		if parent == nil || parent.stale {
			return -1, fmt.Sprintf("its parent %#x is unreachable", r.Parent), 0
		}
		if !parent.isDir() {
			return -1, fmt.Sprintf("its parent %#x is not a directory", r.Parent), 0
		}
		p, pe := f.pathOf(parent)
		if pe != 0 {
			return -1, "parent: " + pe.Error(), pe
		}
		fd, e = f.openBeneathAt(p.fd, r.Path)
		p.put()
	case r.Loc == migstate.LocFileHandle:
		return l.openHandleRecord(&r.Handle)
	default:
		return -1, "unreachable on the source", 0
	}
	if e != 0 {
		return -1, "open: " + e.Error(), e
	}
	return fd, "", 0
}

// sameHandle compares i's file handle with the source's reference (type
// and bytes: mount ids differ between hosts) and says how they differ.
func (f *FS) sameHandle(i *inode, ref *migstate.FileHandle) string {
	h, err := f.handleRecordOf(i)
	switch {
	case err != nil:
		return "no file handle to compare with the source's: " + err.Error()
	case h.Type != ref.Type || !bytes.Equal(h.Bytes, ref.Bytes):
		return fmt.Sprintf("not the object the source had: file handle %#x:%x, the source's %#x:%x", h.Type, h.Bytes, ref.Type, ref.Bytes)
	}
	return ""
}

// mountFDs opens the mounts of a state's file handles, each once, on
// first use: a read-only fd of its path in the share (open_by_handle_at
// refuses O_PATH fds), which identifies the mount it opens handles on.
type mountFDs struct {
	f     *FS
	paths []migstate.MountPath
	fds   map[uint64]int
	whys  map[uint64]string
}

func (m *mountFDs) get(id uint64) (int, string, syscall.Errno) {
	if fd, ok := m.fds[id]; ok {
		return fd, m.whys[id], 0
	}
	if m.fds == nil {
		m.fds, m.whys = map[uint64]int{}, map[uint64]string{}
	}
	k := slices.IndexFunc(m.paths, func(p migstate.MountPath) bool { return p.MountID == id })
	if k < 0 {
		m.fds[id], m.whys[id] = -1, fmt.Sprintf("the source gave no path for its mount %d", id)
		return -1, m.whys[id], 0
	}
	fd, why, e := m.f.openMount(m.paths[k].Path)
	if outOfResources(e) {
		return -1, why, e // not remembered: the load fails anyway
	}
	m.fds[id], m.whys[id] = fd, why
	if fd < 0 {
		m.f.log.Warn("passthrough: migration: cannot open a mount of the source's file handles", "mount_id", id,
			"path", m.paths[k].Path, "why", why)
	}
	return fd, why, 0
}

func (m *mountFDs) close() {
	for _, fd := range m.fds {
		if fd >= 0 {
			sysClose(fd)
		}
	}
}

// openMount opens rel (a mount path: "." or a state path) read-only, a
// directory or a regular file only.
func (f *FS) openMount(rel string) (int, string, syscall.Errno) {
	pfd := f.rootFD()
	if rel != "." {
		var e syscall.Errno
		if pfd, e = f.openBeneath(rel); e != 0 {
			return -1, "open: " + e.Error(), e
		}
		defer f.closeInodeFD(pfd)
	}
	var st unix.Statx_t
	if e := statxFD(pfd, &st); e != 0 {
		return -1, "statx: " + e.Error(), e
	}
	fl := unix.O_RDONLY | unix.O_NONBLOCK | unix.O_CLOEXEC
	switch uint32(st.Mode) & unix.S_IFMT {
	case unix.S_IFDIR:
		fl |= unix.O_DIRECTORY
	case unix.S_IFREG:
	default:
		return -1, fmt.Sprintf("not a directory or regular file (type %#o)", uint32(st.Mode)&unix.S_IFMT), 0
	}
	var b fdName
	fd, e := sysOpenat(f.procSelfFD, procName(&b, pfd), fl, 0)
	if e != 0 {
		return -1, "open: " + e.Error(), e
	}
	return fd, "", 0
}

// openHandleRecord opens a source's file handle as an O_PATH fd (counted
// in inodeFDs) on the mount the state names for it. It needs
// CAP_DAC_READ_SEARCH. A directory is opened only if it is inside the
// shared directory; a non-directory is checked once the directories are
// staged (stagePending; inside.go says how and why).
func (l *loader) openHandleRecord(h *migstate.FileHandle) (int, string, syscall.Errno) {
	f := l.f
	mfd, why, e := l.mounts.get(h.MountID)
	if mfd < 0 {
		return -1, why, e
	}
	fd, err := unix.OpenByHandleAt(mfd, unix.NewFileHandle(h.Type, h.Bytes), unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC)
	if err != nil {
		e := toErrno(err)
		why := "open_by_handle_at: " + e.Error()
		if e == syscall.EPERM {
			why += " (file handles need CAP_DAC_READ_SEARCH)"
		}
		return -1, why, e
	}
	f.inodeFDs.Add(1)
	var st unix.Statx_t
	if e := statxFD(fd, &st); e != 0 {
		f.closeInodeFD(fd)
		return -1, "statx: " + e.Error(), e
	}
	if uint32(st.Mode)&unix.S_IFMT == unix.S_IFDIR {
		if ok, why := l.inside.dirInside(fd, &st); !ok {
			f.closeInodeFD(fd)
			return -1, "the file handle opens a directory outside the shared directory: " + why, 0
		}
	}
	return fd, "", 0
}

// reopenHandle opens i for a handle as OPEN (or OPENDIR) would: through
// /proc/self/fd, only regular files and directories. flags are host open
// flags (migstate.Handle.OpenFlags). It returns the fd and host flags, or
// -1, why not and the errno.
func (f *FS) reopenHandle(i *inode, dir bool, flags uint32, writeback bool) (int, int, string, syscall.Errno) {
	fl := unix.O_RDONLY | unix.O_DIRECTORY
	if !dir {
		fl = f.hostOpenFlagsWB(flags, writeback) &^ (unix.O_TRUNC | unix.O_CLOEXEC)
		if f.opts.ReadOnly && writes(fl) {
			return -1, 0, "opened for writing, and the share is read-only here", syscall.EROFS
		}
		if i.isDir() {
			fl |= unix.O_DIRECTORY
		}
	}
	p, e := f.pathOf(i)
	if e != 0 {
		return -1, 0, e.Error(), e
	}
	defer p.put()
	fd, e := f.reopen(p, fl)
	if e != 0 {
		return -1, 0, "open: " + e.Error(), e
	}
	if dir {
		fl = unix.O_RDONLY
	}
	return fd, fl | unix.O_CLOEXEC, "", 0
}

// install replaces the session with the staged objects. Ids the tables
// cannot hold in a slot go to their overflow maps; only indexes below 1M
// plus four per record take a slot, so a foreign state's large ids do not
// grow the free lists (4 bytes per index below a slot used) beyond a few
// MB.
func (f *FS) install(st *staged, caps uint64) error {
	f.stopCollecting(true)
	f.sessionMu.Lock()
	defer f.sessionMu.Unlock()
	f.reset()
	f.setSession(caps)
	limit := uint32(min(maxSlots, 4*(len(st.inodes)+len(st.handles))+1<<20))
	var overNodes, overHandles int
	for k, i := range st.inodes {
		ks := &f.keys[i.key.hash()%keyShards]
		ks.mu.Lock()
		ok := ks.get(i.key) == nil
		if ok {
			if f.nodes.restore(i.id, i, limit) {
				overNodes++
			}
			ks.add(i)
		}
		ks.mu.Unlock()
		if !ok {
			// Cannot happen after stage and reset; if it did, leave
			// no half-installed session behind.
			st.inodes = st.inodes[k:]
			f.reset()
			st.release()
			f.initDone = false
			return fmt.Errorf("migration: node %#x could not be installed", i.id)
		}
	}
	for _, h := range st.handles {
		if f.handles.restore(h.id, h, limit) {
			overHandles++
		}
	}
	if overNodes+overHandles > 0 {
		f.log.Info("passthrough: migration: ids this daemon would not issue are kept aside",
			"node_ids", overNodes, "file_handles", overHandles)
	}
	return nil
}
