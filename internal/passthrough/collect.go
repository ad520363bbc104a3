package passthrough

import (
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/passthrough/migstate"
)

// Live migration, in the Rust virtiofsd 1.13's format and modes, to and
// from either daemon. As the Rust daemon splits src/passthrough/
// device_state/, three phases, a file each: the path collection a source
// starts when dirty logging starts (this file), SaveState (save.go) and
// LoadState (load.go). The records and the stream they travel in are
// package migstate's.
//
// Source, find-paths mode: when the front end turns dirty logging on,
// PrepareMigration starts a goroutine that finds a path below the shared
// directory for every inode the guest holds (and, with VerifyHandles, its
// file handle); SaveState (every ring stopped) waits for it, finds paths for
// the inodes it did not see, re-checks the collected ones with
// MigrationOptions.ConfirmPaths, and writes the records. A path is found
// through the inode's /proc/self/fd link and verified by opening it beneath
// the shared directory and comparing the object; failing that, by a bounded
// search of the share. An inode with no path is sent as Invalid.
//
// Source, file-handles mode: every inode travels as its file handle
// (name_to_handle_at), with a path in the share for each mount they are on;
// an object unlinked on the host but still open migrates too. An inode
// without a handle (a file system that has none) falls back to its path.

// migration is the source's path collection, started by PrepareMigration.
type migration struct {
	mu  sync.Mutex
	cur *collection // nil: none started (or cancelled)
}

type collection struct {
	stop chan struct{}
	done chan struct{}
	// Written by the collector, read after done: a path per inode
	// (find-paths), a file handle per inode (file-handles mode, or
	// find-paths with VerifyHandles). An object's handle never changes.
	paths   map[*inode]string
	handles map[*inode]migstate.FileHandle
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
	go f.collect(c)
}

// collect fills c for the inodes the guest holds now; SaveState finds
// those made from now on.
func (f *FS) collect(c *collection) {
	defer close(c.done)
	live := holdAll(&f.nodes)
	defer putAll(live)
	start := time.Now()
	mo := &f.opts.Migration
	if mo.Mode == MigrationFileHandles || mo.VerifyHandles {
		c.handles = f.collectHandles(live, c.stop)
	}
	if mo.Mode == MigrationFindPaths {
		c.paths = f.findPaths(live, c.stop)
	}
	if !stopped(c.stop) {
		f.log.Info("passthrough: migration: paths collected", "mode", mo.Mode, "inodes", len(live),
			"paths", len(c.paths), "handles", len(c.handles), "took", time.Since(start))
	}
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

// collected waits for the collection under way, if any, and returns it
// (nil without one).
func (f *FS) collected() *collection {
	f.mig.mu.Lock()
	c := f.mig.cur
	f.mig.mu.Unlock()
	if c != nil {
		<-c.done
	}
	return c
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
	return f.fdLink(f.rootFD())
}

func (f *FS) fdLink(fd int) (string, bool) {
	var b fdName
	var buf [migstate.MaxPath + 1 + len(" (deleted)")]byte
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
	if migstate.CheckPath(rel) != nil {
		return "", false
	}
	return rel, true
}

// openBeneath opens rel (a checked state path) below the shared directory as
// an O_PATH fd, following no symlink and never leaving the share. The fd
// counts in inodeFDs. Collection verifies paths with it, a destination
// reopens them.
func (f *FS) openBeneath(rel string) (int, syscall.Errno) {
	return f.openBeneathAt(f.rootFD(), rel)
}

// openBeneathAt is openBeneath below directory dirfd (an inode's fd).
func (f *FS) openBeneathAt(dirfd int, rel string) (int, syscall.Errno) {
	p := make([]byte, len(rel)+1)
	copy(p, rel)
	if f.openat2.Load() {
		return f.openBeneath2(dirfd, &p[0])
	}
	// One component at a time: O_NOFOLLOW gives a symlink's own fd, below
	// which the next component fails with ENOTDIR; ".." never occurs.
	cur := dirfd
	for len(p) > 1 {
		n := 0
		for p[n] != '/' && p[n] != 0 {
			n++
		}
		last := p[n] == 0
		p[n] = 0
		fd, e := sysOpenat(cur, &p[0], unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if cur != dirfd {
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
	if !keyOf(st).sameObject(i.key) || st.Mode&unix.S_IFMT != i.ftype {
		return false
	}
	if i.key.handle != "" {
		h, err := nameToHandle(fd)
		return err == nil && h == i.key.handle
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

// shareSearch is one search of the share for the objects of some inodes.
type shareSearch struct {
	f     *FS
	want  map[objKey][]*inode // the inodes sought, by object
	inos  map[uint64]bool     // their inode numbers
	paths map[*inode]string   // what was found
	left  int                 // inodes still sought
	seen  int                 // entries examined
	queue []string            // directories to read
	buf   []byte
}

// searchShare walks the shared directory breadth first, never following a
// symlink, and records in paths a path for each of missing it meets. It
// stops when all are found, after maxSearchEntries entries, or when stop
// is closed (then it returns false).
func (f *FS) searchShare(missing []*inode, paths map[*inode]string, stop <-chan struct{}) bool {
	s := &shareSearch{
		f:     f,
		want:  make(map[objKey][]*inode, len(missing)),
		inos:  make(map[uint64]bool, len(missing)),
		paths: paths,
		left:  len(missing),
		queue: []string{""},
		buf:   make([]byte, dirBufSize),
	}
	for _, i := range missing {
		k := objKey{i.key.dev, i.key.ino, i.key.mntID}
		s.want[k] = append(s.want[k], i)
		s.inos[i.key.ino] = true
	}
	for len(s.queue) > 0 && s.left > 0 && s.seen < maxSearchEntries {
		if stopped(stop) {
			return false
		}
		dir := s.queue[0]
		s.queue = s.queue[1:]
		s.readDir(dir)
	}
	return true
}

// readDir examines the entries of dir, a directory of the share.
func (s *shareSearch) readDir(dir string) {
	dfd, ok := s.f.openSearchDir(dir)
	if !ok {
		return
	}
	defer sysClose(dfd)
	for s.left > 0 && s.seen < maxSearchEntries {
		n, e := sysGetdents(dfd, s.buf)
		if e != 0 || n <= 0 {
			return
		}
		for rec := s.buf[:n]; ; {
			d, ok := parseDirent(rec)
			if !ok {
				break
			}
			rec = rec[d.reclen:]
			if len(d.name) == 0 || isDotOrDotDot(d.name) {
				continue
			}
			s.seen++
			s.examine(dfd, dir, d)
		}
	}
}

// examine claims entry d of directory dir (open as dfd) for the inodes of
// its object, and queues it if it is a directory.
func (s *shareSearch) examine(dfd int, dir string, d dirent64) {
	// Only directories (which may be mount points, whose d_ino is the
	// covered directory's) and wanted inode numbers need a statx.
	if d.typ != unix.DT_DIR && d.typ != unix.DT_UNKNOWN && !s.inos[d.ino] {
		return
	}
	var cn cname
	p := cn.set(d.name)
	var st unix.Statx_t
	if sysStatx(dfd, p, unix.AT_SYMLINK_NOFOLLOW, statxMask, &st) != 0 {
		return
	}
	child := string(d.name)
	if dir != "" {
		child = dir + "/" + child
	}
	if len(child) > migstate.MaxPath {
		return
	}
	k := objKey{uint64(unix.Mkdev(st.Dev_major, st.Dev_minor)), st.Ino, st.Mnt_id}
	if c := s.want[k]; len(c) > 0 {
		s.left -= s.f.claim(dfd, p, &st, child, c, s.paths)
	}
	if uint32(st.Mode)&unix.S_IFMT == unix.S_IFDIR && len(s.queue) < maxSearchDirs {
		s.queue = append(s.queue, child)
	}
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
	pfd := f.rootFD()
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

// collectHandles gets the file handle of each of inodes (held with a use
// reference by the caller); nil when stop is closed.
func (f *FS) collectHandles(inodes []*inode, stop <-chan struct{}) map[*inode]migstate.FileHandle {
	hs := make(map[*inode]migstate.FileHandle, len(inodes))
	for _, i := range inodes {
		if stopped(stop) {
			return nil
		}
		if h, err := f.handleRecordOf(i); err == nil {
			hs[i] = h
		}
	}
	return hs
}

// handleRecordOf returns i's file handle with its mount id, as
// name_to_handle_at gives them (the id statx reports as stx_mnt_id).
func (f *FS) handleRecordOf(i *inode) (migstate.FileHandle, error) {
	if i.mnt != nil {
		return migstate.FileHandle{MountID: i.key.mntID, Type: handleType(i.key.handle), Bytes: handleBytes(i.key.handle)}, nil
	}
	r, e := f.pathOf(i)
	if e != 0 {
		return migstate.FileHandle{}, e
	}
	defer r.put()
	h, mnt, err := unix.NameToHandleAt(r.fd, "", unix.AT_EMPTY_PATH)
	if err != nil {
		return migstate.FileHandle{}, err
	}
	return migstate.FileHandle{MountID: uint64(mnt), Type: h.Type(), Bytes: h.Bytes()}, nil
}
