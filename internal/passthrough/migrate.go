package passthrough

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// Live migration in find-paths mode (as the Rust virtiofsd 1.13 does it).
//
// Source: when the front end turns dirty logging on, PrepareMigration
// starts a goroutine that finds a path below the shared directory for every
// inode the guest holds; SaveState (every ring stopped) waits for it, finds
// paths for the inodes it did not see, re-checks the collected ones with
// MigrationOptions.ConfirmPaths, and writes the records (state.go) in our
// encoding (stateenc.go). A path is found through the inode's
// /proc/self/fd link and verified by opening it beneath the shared
// directory and comparing the object; failing that, by a bounded search of
// the share. An inode with no path is sent as unreachable.
//
// Destination: LoadState decodes the whole stream, validates it, reopens
// every inode by its path beneath the shared directory (never following a
// symlink, never leaving the share) and every handle from its inode as OPEN
// does, and only then replaces its tables, at the very same ids. An inode
// that cannot be reopened fails the load (MigrationAbort) or is installed
// stale (MigrationGuestError). Locks do not travel.

// migration is the source's path collection, started by PrepareMigration.
type migration struct {
	mu  sync.Mutex
	cur *collection // nil: none started (or cancelled)
}

type collection struct {
	stop  chan struct{}
	done  chan struct{}
	paths map[*inode]string // written by the collector, read after done
}

// PrepareMigration starts collecting a path for every inode, in the
// background (the front end turned dirty logging on: a migration starts).
// It returns at once; a collection already under way goes on.
func (f *FS) PrepareMigration() {
	f.mig.mu.Lock()
	defer f.mig.mu.Unlock()
	if f.mig.cur != nil {
		return
	}
	c := &collection{stop: make(chan struct{}), done: make(chan struct{})}
	f.mig.cur = c
	go func() {
		defer close(c.done)
		// Inodes made from now on are not seen: SaveState finds theirs.
		var live []*inode
		f.nodes.each(func(i *inode) {
			if i.tryRef() {
				live = append(live, i)
			}
		})
		defer func() {
			for _, i := range live {
				i.put()
			}
		}()
		start := time.Now()
		c.paths = f.findPaths(live, c.stop)
		if c.paths != nil {
			slog.Info("passthrough: migration: paths collected", "inodes", len(live), "found", len(c.paths),
				"took", time.Since(start))
		}
	}()
}

// CancelMigration stops a collection and drops what it found (the
// migration was cancelled, or it completed and the VM resumed here). It
// returns at once; the collector notices soon after.
func (f *FS) CancelMigration() { f.stopCollecting(false) }

func (f *FS) stopCollecting(wait bool) {
	f.mig.mu.Lock()
	c := f.mig.cur
	f.mig.cur = nil
	f.mig.mu.Unlock()
	if c == nil {
		return
	}
	close(c.stop)
	if wait {
		<-c.done
	}
}

func stopped(stop <-chan struct{}) bool {
	select {
	case <-stop:
		return true
	default:
		return false
	}
}

// rootLink is the /proc/self/fd link of the shared directory: "/" inside
// the namespace and chroot sandboxes, the host path without a sandbox.
func (f *FS) rootLink() (string, bool) {
	return f.fdLink(f.root.fd)
}

func (f *FS) fdLink(fd int) (string, bool) {
	var b fdName
	var buf [maxStatePath + 1 + len(" (deleted)")]byte
	n, e := sysReadlinkat(f.procSelfFD, procName(&b, fd), buf[:])
	if e != 0 || n <= 0 || n >= len(buf) {
		return "", false
	}
	return string(buf[:n]), true
}

// relLink turns an fd's /proc/self/fd link into a path relative to the
// shared directory, whose own link is root. A deleted object's link, one
// outside the share (or not a path at all: "pipe:[…]", "/memfd:…" is
// caught by the verification) is not a path.
func relLink(link, root string) (string, bool) {
	if strings.HasSuffix(link, " (deleted)") || !strings.HasPrefix(link, "/") {
		return "", false
	}
	var rel string
	switch {
	case root == "/":
		rel = link[1:]
	case len(link) > len(root) && link[len(root)] == '/' && strings.HasPrefix(link, root):
		rel = link[len(root)+1:]
	default:
		return "", false
	}
	if checkStatePath(rel) != nil {
		return "", false
	}
	return rel, true
}

// openBeneath opens rel (a checked state path) below the shared directory as
// an O_PATH fd, following no symlink and never leaving the share. The fd
// counts in inodeFDs.
func (f *FS) openBeneath(rel string) (int, syscall.Errno) {
	p := make([]byte, len(rel)+1)
	copy(p, rel)
	if f.openat2.Load() {
		return f.openBeneath2(f.root.fd, &p[0])
	}
	// One component at a time: O_NOFOLLOW gives a symlink's own fd, below
	// which the next component fails with ENOTDIR; ".." never occurs.
	cur := f.root.fd
	for len(p) > 1 {
		n := 0
		for p[n] != '/' && p[n] != 0 {
			n++
		}
		last := p[n] == 0
		p[n] = 0
		fd, e := sysOpenat(cur, &p[0], unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if cur != f.root.fd {
			sysClose(cur)
		}
		if e != 0 {
			return -1, e
		}
		cur = fd
		if last {
			break
		}
		p = p[n+1:]
	}
	f.inodeFDs.Add(1)
	return cur, 0
}

func (f *FS) closeInodeFD(fd int) {
	sysClose(fd)
	f.inodeFDs.Add(-1)
}

// isObject reports whether O_PATH fd (whose statx is st) is i's object: the
// same device, inode number and mount, the same type and, for an inode
// held by file handle, the same handle (an inode number can be reused).
func (f *FS) isObject(fd int, st *unix.Statx_t, i *inode) bool {
	if !keyOf(st).sameObject(i.key) || uint32(st.Mode)&unix.S_IFMT != i.ftype {
		return false
	}
	if i.key.handle != "" {
		h, err := nameToHandle(fd)
		return err == nil && handleKey(h) == i.key.handle
	}
	return true
}

// verifyPath reports whether rel still leads to i's object.
func (f *FS) verifyPath(rel string, i *inode) bool {
	fd, e := f.openBeneath(rel)
	if e != 0 {
		return false
	}
	defer f.closeInodeFD(fd)
	var st unix.Statx_t
	return statxFD(fd, &st) == 0 && f.isObject(fd, &st, i)
}

// pathByLink finds i's path through its /proc/self/fd link.
func (f *FS) pathByLink(i *inode, root string) (string, bool) {
	r, errno := f.pathOf(i)
	if errno != 0 {
		return "", false
	}
	defer r.put()
	link, ok := f.fdLink(r.fd)
	if !ok {
		return "", false
	}
	rel, ok := relLink(link, root)
	if !ok || !f.verifyPath(rel, i) {
		return "", false
	}
	return rel, true
}

// findPaths finds a path for each of inodes (held with a use reference by
// the caller): the /proc link first, then one search of the share for all
// the others. It returns nil when stop is closed.
func (f *FS) findPaths(inodes []*inode, stop <-chan struct{}) map[*inode]string {
	paths := make(map[*inode]string, len(inodes))
	root, rootOK := f.rootLink()
	var missing []*inode
	for _, i := range inodes {
		if stopped(stop) {
			return nil
		}
		if i.stale {
			continue
		}
		if rootOK {
			if p, ok := f.pathByLink(i, root); ok {
				paths[i] = p
				continue
			}
		}
		missing = append(missing, i)
	}
	if len(missing) > 0 && !f.searchShare(missing, paths, stop) {
		return nil
	}
	return paths
}

// Bounds of the search of the share (the fallback for paths the /proc links
// did not give): entries examined, and directories queued.
const (
	maxSearchEntries = 1 << 20
	maxSearchDirs    = 1 << 18
)

type objKey struct{ dev, ino, mnt uint64 }

// searchShare walks the shared directory breadth first, never following a
// symlink, and records in paths a path for each of missing it meets. It
// stops when all are found, after maxSearchEntries entries, or when stop
// is closed (then it returns false).
func (f *FS) searchShare(missing []*inode, paths map[*inode]string, stop <-chan struct{}) bool {
	want := make(map[objKey][]*inode, len(missing))
	inos := make(map[uint64]bool, len(missing))
	for _, i := range missing {
		k := objKey{i.key.dev, i.key.ino, i.key.mntID}
		want[k] = append(want[k], i)
		inos[i.key.ino] = true
	}
	left := len(missing)
	queue := []string{""}
	buf := make([]byte, dirBufSize)
	seen := 0
	for len(queue) > 0 && left > 0 && seen < maxSearchEntries {
		if stopped(stop) {
			return false
		}
		dir := queue[0]
		queue = queue[1:]
		dfd, ok := f.openSearchDir(dir)
		if !ok {
			continue
		}
		for left > 0 && seen < maxSearchEntries {
			n, e := sysGetdents(dfd, buf)
			if e != 0 || n <= 0 {
				break
			}
			for rec := buf[:n]; len(rec) >= 19; {
				reclen := int(binary.LittleEndian.Uint16(rec[16:]))
				if reclen < 19 || reclen > len(rec) {
					break
				}
				dino, dtype, name := binary.LittleEndian.Uint64(rec), rec[18], rec[19:reclen]
				rec = rec[reclen:]
				if k := bytes.IndexByte(name, 0); k >= 0 {
					name = name[:k]
				}
				if len(name) == 0 || isDotOrDotDot(name) {
					continue
				}
				seen++
				// Only directories (which may be mount points, whose
				// d_ino is the covered directory's) and wanted inode
				// numbers need a statx.
				if dtype != unix.DT_DIR && dtype != unix.DT_UNKNOWN && !inos[dino] {
					continue
				}
				var cn cname
				p := cn.set(name)
				var st unix.Statx_t
				if sysStatx(dfd, p, unix.AT_SYMLINK_NOFOLLOW, statxMask, &st) != 0 {
					continue
				}
				child := string(name)
				if dir != "" {
					child = dir + "/" + child
				}
				if len(child) > maxStatePath {
					continue
				}
				k := objKey{uint64(unix.Mkdev(st.Dev_major, st.Dev_minor)), st.Ino, st.Mnt_id}
				if c := want[k]; len(c) > 0 {
					left -= f.claim(dfd, p, &st, child, c, paths)
				}
				if uint32(st.Mode)&unix.S_IFMT == unix.S_IFDIR && len(queue) < maxSearchDirs {
					queue = append(queue, child)
				}
			}
		}
		sysClose(dfd)
	}
	return true
}

// claim records child as the path of the inodes of cands it is the object
// of (and has none yet), and returns how many.
func (f *FS) claim(dfd int, name *byte, st *unix.Statx_t, child string, cands []*inode, paths map[*inode]string) int {
	fd, e := sysOpenat(dfd, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if e != 0 {
		return 0
	}
	defer sysClose(fd)
	n := 0
	for _, i := range cands {
		if _, done := paths[i]; !done && f.isObject(fd, st, i) {
			paths[i] = child
			n++
		}
	}
	return n
}

// openSearchDir opens a directory of the search for reading.
func (f *FS) openSearchDir(rel string) (int, bool) {
	pfd := f.root.fd
	if rel != "" {
		var e syscall.Errno
		if pfd, e = f.openBeneath(rel); e != 0 {
			return -1, false
		}
		defer f.closeInodeFD(pfd)
	}
	var b fdName
	fd, e := sysOpenat(f.procSelfFD, procName(&b, pfd), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	return fd, e == 0
}

// --- source: SaveState ---

// SaveState writes the state of the guest's session to w: every inode the
// guest holds with a path to reopen it, every open handle. Call it with no
// request running (every ring stopped). Locks are not saved.
func (f *FS) SaveState(w io.Writer) error {
	s := f.snapshot()
	return encodeState(w, s)
}

// snapshot builds the records of the current tables.
func (f *FS) snapshot() *migState {
	f.mig.mu.Lock()
	c := f.mig.cur
	f.mig.mu.Unlock()
	var collected map[*inode]string
	if c != nil {
		<-c.done
		collected = c.paths
	}

	type held struct {
		i       *inode
		nlookup uint64
	}
	var inodes []held
	lockable := []*inode{f.root}
	for si := range f.keys {
		ks := &f.keys[si]
		ks.mu.Lock()
		for _, i := range ks.m {
			if !i.pinned && i.tryRef() {
				inodes = append(inodes, held{i, i.nlookup})
				lockable = append(lockable, i)
			}
		}
		ks.mu.Unlock()
	}
	defer func() {
		for _, h := range inodes {
			h.i.put()
		}
	}()
	slices.SortFunc(inodes, func(a, b held) int { return cmpU64(a.i.id, b.i.id) })

	s := &migState{Inodes: make([]inodeRecord, len(inodes))}
	var need []*inode
	for k, h := range inodes {
		i := h.i
		s.Inodes[k] = inodeRecord{ID: i.id, Nlookup: h.nlookup, Type: i.ftype}
		if i.stale {
			continue
		}
		if p, ok := collected[i]; ok && (!f.opts.Migration.ConfirmPaths || f.verifyPath(p, i)) {
			s.Inodes[k].Path = p
			continue
		}
		need = append(need, i)
	}
	var found map[*inode]string
	if len(need) > 0 {
		found = f.findPaths(need, nil)
	}
	for k, r := range s.Inodes {
		if r.Path == "" {
			if p, ok := found[inodes[k].i]; ok {
				s.Inodes[k].Path = p
				continue
			}
			s.Inodes[k].Unreachable = true
			slog.Warn("passthrough: migration: no path for an inode, sent as unreachable",
				"node", r.ID, "type", fmt.Sprintf("%#o", r.Type), "stale", inodes[k].i.stale)
		}
	}

	var handles []*handle
	f.handles.each(func(h *handle) {
		if h.tryRef() {
			handles = append(handles, h)
		}
	})
	defer func() {
		for _, h := range handles {
			h.put()
		}
	}()
	slices.SortFunc(handles, func(a, b *handle) int { return cmpU64(a.id, b.id) })
	locked := map[*inode]bool{}
	for _, h := range handles {
		if h.flocked.Load() {
			locked[h.ino] = true
		}
		if h.ino != f.root && f.node(h.ino.id) != h.ino {
			// The guest forgot the inode of an open handle, so it
			// cannot use the handle any more.
			slog.Warn("passthrough: migration: handle of a forgotten inode not sent", "fh", h.id, "node", h.ino.id)
			continue
		}
		s.Handles = append(s.Handles, handleRecord{
			ID:    h.id,
			Inode: h.ino.id,
			Flags: uint32(h.flags) &^ (unix.O_CREAT | unix.O_EXCL | unix.O_TRUNC | unix.O_CLOEXEC),
			Dir:   h.kind == handleDir,
		})
	}
	for _, i := range lockable {
		i.lockMu.Lock()
		n := len(i.plocks)
		i.lockMu.Unlock()
		if n > 0 || locked[i] {
			slog.Warn("passthrough: migration: locks on an inode are dropped (they do not migrate)",
				"node", i.id, "posix_lock_owners", n, "flock", locked[i])
		}
	}
	return s
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

// --- destination: LoadState ---

// LoadState reads a state written by SaveState from r, to end of stream,
// and installs it as a session with capabilities caps, as Init(caps) would
// plus the restored inodes and handles, replacing whatever the FS held. On
// error nothing is installed and every fd opened meanwhile is closed. Call
// it with no request running.
func (f *FS) LoadState(r io.Reader, caps uint64) error {
	s, err := decodeState(r, maxStateSize)
	if err != nil {
		return err
	}
	return f.loadRecords(s, caps)
}

// loadRecords validates, reopens and installs decoded records.
func (f *FS) loadRecords(s *migState, caps uint64) error {
	if err := s.validate(); err != nil {
		return fmt.Errorf("passthrough migration state: %w", err)
	}
	st, err := f.stage(s, caps)
	if err != nil {
		return err
	}
	return f.install(st, caps)
}

// staged holds reopened objects not yet in any table; each carries the
// reference the table will own.
type staged struct {
	inodes  []*inode
	handles []*handle
}

func (st *staged) release() {
	for _, h := range st.handles {
		h.put()
	}
	for _, i := range st.inodes {
		i.put()
	}
	st.handles, st.inodes = nil, nil
}

// stage reopens every record. Unreachable objects follow
// Options.Migration.OnError.
func (f *FS) stage(s *migState, caps uint64) (_ *staged, err error) {
	st := &staged{inodes: make([]*inode, 0, len(s.Inodes)), handles: make([]*handle, 0, len(s.Handles))}
	defer func() {
		if err != nil {
			st.release()
		}
	}()
	abort := f.opts.Migration.OnError == MigrationAbort
	byID := make(map[uint64]*inode, len(s.Inodes)+1)
	byID[rootID] = f.root
	keys := make(map[inodeKey]uint64, len(s.Inodes)+1)
	keys[f.root.key] = rootID
	for k := range s.Inodes {
		r := &s.Inodes[k]
		var i *inode
		why := "unreachable on the source"
		if !r.Unreachable {
			var e syscall.Errno
			i, why, e = f.reopenInode(r)
			if outOfResources(e) {
				return nil, fmt.Errorf("migration: node %#x (%q): %s", r.ID, r.Path, why)
			}
			if i != nil {
				if other, dup := keys[i.key]; dup {
					i.put()
					i, why = nil, fmt.Sprintf("opens as the object of node %#x", other)
				}
			}
		}
		if i == nil {
			if abort {
				return nil, fmt.Errorf("migration: node %#x (%q): %s", r.ID, r.Path, why)
			}
			slog.Warn("passthrough: migration: inode restored stale", "node", r.ID, "path", r.Path, "why", why)
			i = &inode{key: inodeKey{ino: r.ID, stale: true}, fd: -1, ftype: r.Type, stale: true, fs: f}
			i.refs.Store(1)
		}
		i.id, i.nlookup = r.ID, r.Nlookup
		keys[i.key] = r.ID
		byID[r.ID] = i
		st.inodes = append(st.inodes, i)
	}
	writeback := caps&gofuse.CAP_WRITEBACK_CACHE != 0
	for k := range s.Handles {
		r := &s.Handles[k]
		i := byID[r.Inode] // validate checked it exists
		h := &handle{id: r.ID, fd: -1, ino: i, flags: int(r.Flags), wait: bufvec.MayWait}
		if r.Dir {
			h.kind, h.dir, h.flags = handleDir, &dirStream{}, unix.O_RDONLY
		}
		var why string
		if i.stale {
			why = "its inode is stale"
		} else {
			var e syscall.Errno
			h.fd, h.flags, why, e = f.reopenHandle(i, r, writeback)
			if outOfResources(e) {
				return nil, fmt.Errorf("migration: handle %#x of node %#x: %s", r.ID, r.Inode, why)
			}
		}
		if h.fd < 0 {
			if abort {
				return nil, fmt.Errorf("migration: handle %#x of node %#x: %s", r.ID, r.Inode, why)
			}
			if !i.stale {
				slog.Warn("passthrough: migration: handle restored stale", "fh", r.ID, "node", r.Inode, "why", why)
			}
			h.stale = true
		} else {
			f.handleFDs.Add(1)
			if !r.Dir {
				h.wait = i.fileWait(h.fd)
			}
		}
		i.refs.Add(1) // the handle's reference
		h.refs.Store(1)
		st.handles = append(st.handles, h)
	}
	return st, nil
}

// outOfResources tells the errors of this daemon's limits (fds, memory)
// from those of the object: they fail a load whatever OnError says, since
// the object itself may be fine.
func outOfResources(e syscall.Errno) bool {
	return e == syscall.EMFILE || e == syscall.ENFILE || e == syscall.ENOMEM
}

// reopenInode opens r's path beneath the shared directory and makes an
// inode of it (nil, why not and the errno when it does not open, or opens
// as another type).
func (f *FS) reopenInode(r *inodeRecord) (*inode, string, syscall.Errno) {
	fd, e := f.openBeneath(r.Path)
	if e != 0 {
		return nil, "open: " + e.Error(), e
	}
	var sx unix.Statx_t
	if e := statxFD(fd, &sx); e != 0 {
		f.closeInodeFD(fd)
		return nil, "statx: " + e.Error(), e
	}
	if t := uint32(sx.Mode) & unix.S_IFMT; t != r.Type {
		f.closeInodeFD(fd)
		return nil, fmt.Sprintf("type %#o, saved as %#o", t, r.Type), 0
	}
	key, fh, e := f.keyFor(fd, &sx)
	if e != 0 {
		f.closeInodeFD(fd)
		return nil, "file handle: " + e.Error(), e
	}
	i, e := f.newInode(fd, &sx, key, fh)
	if e != 0 {
		return nil, "file handle: " + e.Error(), e
	}
	return i, "", 0
}

// reopenHandle opens i for handle record r as OPEN (or OPENDIR) would:
// through /proc/self/fd, only regular files and directories. It returns the
// fd and host flags, or -1, why not and the errno.
func (f *FS) reopenHandle(i *inode, r *handleRecord, writeback bool) (int, int, string, syscall.Errno) {
	fl := unix.O_RDONLY | unix.O_DIRECTORY
	if !r.Dir {
		fl = f.hostOpenFlagsWB(r.Flags, writeback) &^ (unix.O_TRUNC | unix.O_CLOEXEC)
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
	if r.Dir {
		fl = unix.O_RDONLY
	}
	return fd, fl | unix.O_CLOEXEC, "", 0
}

// install replaces the session with the staged objects.
func (f *FS) install(st *staged, caps uint64) error {
	f.stopCollecting(true)
	f.sessionMu.Lock()
	defer f.sessionMu.Unlock()
	f.reset()
	f.setSession(caps)
	for k, i := range st.inodes {
		ks := &f.keys[i.key.hash()%keyShards]
		ks.mu.Lock()
		ok := ks.m[i.key] == nil && f.nodes.insertAt(i.id, i)
		if ok {
			ks.m[i.key] = i
		}
		ks.mu.Unlock()
		if !ok {
			// Cannot happen after validate and reset; if it did, leave
			// no half-installed session behind.
			st.inodes = st.inodes[k:]
			f.reset()
			st.release()
			f.initDone = false
			return fmt.Errorf("migration: node %#x could not be installed", i.id)
		}
	}
	for k, h := range st.handles {
		if !f.handles.insertAt(h.id, h) {
			st.inodes, st.handles = nil, st.handles[k:]
			f.reset()
			st.release()
			f.initDone = false
			return fmt.Errorf("migration: handle %#x could not be installed", h.id)
		}
	}
	return nil
}
