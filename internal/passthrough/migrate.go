package passthrough

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"math"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
	"unicode/utf8"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// Live migration, in the Rust virtiofsd 1.13's format and modes, to and
// from either daemon (the stream: stateenc.go; the records: state.go).
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
//
// Destination: LoadState decodes the whole stream, validates it, opens every
// inode by its path beneath the shared directory or below its parent (never
// following a symlink, never leaving the share), or by its file handle
// (open_by_handle_at, which needs CAP_DAC_READ_SEARCH) on a mount it opens
// by path, and every handle from its inode as OPEN does, and only then
// replaces its tables, at the very same ids. An inode that cannot be opened
// (or, given a reference file handle, opens as another object) fails the
// load (MigrationAbort) or is installed stale (MigrationGuestError). Locks
// do not travel.

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
	handles map[*inode]fileHandleRecord
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
		mo := &f.opts.Migration
		if mo.Mode == MigrationFileHandles || mo.VerifyHandles {
			c.handles = f.collectHandles(live, c.stop)
		}
		if mo.Mode == MigrationFindPaths {
			c.paths = f.findPaths(live, c.stop)
		}
		if !stopped(c.stop) {
			slog.Info("passthrough: migration: paths collected", "mode", mo.Mode, "inodes", len(live),
				"paths", len(c.paths), "handles", len(c.handles), "took", time.Since(start))
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
	return f.openBeneathAt(f.root.fd, rel)
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

// collectHandles gets the file handle of each of inodes (held with a use
// reference by the caller); nil when stop is closed.
func (f *FS) collectHandles(inodes []*inode, stop <-chan struct{}) map[*inode]fileHandleRecord {
	hs := make(map[*inode]fileHandleRecord, len(inodes))
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
func (f *FS) handleRecordOf(i *inode) (fileHandleRecord, error) {
	if i.fh != nil {
		return fileHandleRecord{MountID: i.key.mntID, Type: i.fh.h.Type(), Bytes: i.fh.h.Bytes()}, nil
	}
	r, e := f.pathOf(i)
	if e != 0 {
		return fileHandleRecord{}, e
	}
	defer r.put()
	return fdHandleRecord(r.fd)
}

func fdHandleRecord(fd int) (fileHandleRecord, error) {
	h, mnt, err := unix.NameToHandleAt(fd, "", unix.AT_EMPTY_PATH)
	if err != nil {
		return fileHandleRecord{}, err
	}
	return fileHandleRecord{MountID: uint64(mnt), Type: h.Type(), Bytes: h.Bytes()}, nil
}

// --- source: SaveState ---

// SaveState writes the state of the guest's session to w (stateenc.go):
// every inode the guest holds, with a way to reopen it, and every open
// handle, in the Rust virtiofsd's format, then our trailer carrying
// session (the FUSE server's record, opaque here). Call it with no request
// running (every ring stopped). Locks are not saved.
func (f *FS) SaveState(w io.Writer, session []byte) error {
	s := f.snapshot()
	s.Ours = true
	s.Session = session
	return encodeState(w, s)
}

// rootRefcount is the Rust daemon's own count on its root node (libfuse's
// 2); its loader frees a root whose count drops to 0.
const rootRefcount = 2

// snapshot builds the records of the current tables.
func (f *FS) snapshot() *migState {
	f.mig.mu.Lock()
	c := f.mig.cur
	f.mig.mu.Unlock()
	var collected map[*inode]string
	var collectedFH map[*inode]fileHandleRecord
	if c != nil {
		<-c.done
		collected, collectedFH = c.paths, c.handles
	}
	mo := &f.opts.Migration
	byHandle := mo.Mode == MigrationFileHandles
	verify := mo.VerifyHandles && !byHandle

	s := &migState{V2: true, NextInode: rootID + 1}
	f.sessionMu.Lock()
	mounted := f.initDone
	f.sessionMu.Unlock()
	if !mounted {
		// As the Rust daemon before INIT: no inodes, not even the root.
		return s
	}
	caps := f.caps.Load()
	s.Opts = negotiatedOpts{
		Writeback:         f.writeback.Load(),
		AnnounceSubmounts: f.submounts.Load(),
		PosixACL:          caps&gofuse.CAP_POSIX_ACL != 0,
		SuppGroups:        caps&gofuse.CAP_CREATE_SUPP_GROUP != 0,
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

	s.Inodes = make([]inodeRecord, 1, len(inodes)+1)
	s.Inodes[0] = inodeRecord{ID: rootID, Refcount: rootRefcount, Loc: locRoot, Type: unix.S_IFDIR}
	if verify {
		if h, err := f.handleRecordOf(f.root); err == nil {
			s.Inodes[0].Verify = &h
		} else {
			slog.Warn("passthrough: migration: no file handle for the shared directory; the destination cannot verify it", "err", err)
		}
	}
	// Records for the inodes, in their order; each needs a path unless
	// its file handle will do.
	recs := s.Inodes[1:1]
	var need []*inode
	onMount := map[uint64][]*inode{}
	for _, h := range inodes {
		i := h.i
		r := inodeRecord{ID: i.id, Refcount: h.nlookup, Type: i.ftype, Loc: locInvalid}
		if !i.stale && byHandle {
			fh, ok := collectedFH[i]
			if !ok {
				var err error
				if fh, err = f.handleRecordOf(i); err != nil {
					slog.Info("passthrough: migration: no file handle for an inode, sending its path", "node", i.id, "err", err)
				} else {
					ok = true
				}
			}
			if ok {
				r.Loc, r.Handle = locFileHandle, fh
				onMount[fh.MountID] = append(onMount[fh.MountID], i)
			}
		}
		if !i.stale && r.Loc == locInvalid {
			if p, ok := collected[i]; ok && (!mo.ConfirmPaths || f.verifyPath(p, i)) {
				r.Loc, r.Path = locFullPath, p
			} else {
				need = append(need, i)
			}
		}
		if verify && !i.stale {
			fh, ok := collectedFH[i]
			if !ok {
				var err error
				if fh, err = f.handleRecordOf(i); err == nil {
					ok = true
				} else {
					slog.Warn("passthrough: migration: no file handle for an inode; the destination cannot verify it", "node", i.id, "err", err)
				}
			}
			if ok {
				r.Verify = &fh
			}
		}
		recs = append(recs, r)
	}
	s.Inodes = s.Inodes[:1+len(recs)]
	var found map[*inode]string
	if len(need) > 0 {
		found = f.findPaths(need, nil)
	}
	for k := range recs {
		r, i := &recs[k], inodes[k].i
		if r.Loc == locInvalid && !i.stale {
			if p, ok := found[i]; ok {
				r.Loc, r.Path = locFullPath, p
			}
		}
		switch {
		case r.Loc == locFullPath && !utf8.ValidString(r.Path):
			// The Rust format's strings are UTF-8: our trailer
			// carries the path, a Rust destination finds the inode
			// Invalid.
			r.Loc, r.RawPath, r.Path = locInvalid, r.Path, ""
			slog.Warn("passthrough: migration: a path that is not UTF-8 travels in our trailer only; a Rust destination would find the inode invalid",
				"node", r.ID)
		case r.Loc == locFullPath && verify:
			// The 1.13 loader checks the file handle of a Path
			// location, not of a FullPath one.
			r.Loc, r.Parent = locPath, rootID
			s.Inodes[0].Refcount++
		case r.Loc == locInvalid:
			slog.Warn("passthrough: migration: no path for an inode, sent as invalid",
				"node", r.ID, "type", fmt.Sprintf("%#o", r.Type), "stale", i.stale)
		}
		s.NextInode = max(s.NextInode, nextID(r.ID))
	}
	if byHandle {
		s.MountPaths = f.mountPaths(onMount)
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
		host := uint32(h.flags) &^ (unix.O_CREAT | unix.O_EXCL | unix.O_TRUNC | unix.O_CLOEXEC)
		rust := host &^ unix.O_APPEND
		dir := h.kind == handleDir
		if dir {
			rust = unix.O_RDONLY | unix.O_DIRECTORY
		}
		s.Handles = append(s.Handles, handleRecord{ID: h.id, Inode: h.ino.id, Flags: int32(rust),
			Known: true, Dir: dir, HostFlags: host})
		s.NextHandle = max(s.NextHandle, nextID(h.id))
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

// nextID is the Rust daemon's next id after id: above it, unless it is the
// largest (a foreign id restored here), which cannot be exceeded.
func nextID(id uint64) uint64 {
	if id == math.MaxUint64 {
		slog.Warn("passthrough: migration: an id of 2^64-1 is in use; the Rust daemon's counter cannot go above it")
		return id
	}
	return id + 1
}

// mountPaths finds, for each mount the file handles of onMount's inodes
// are on, a path in the share on that mount, which a destination opens to
// open the handles with: "." for the share's own mount, else a verified
// path of one of its directories (or a file's directory). A mount without
// one is logged: its inodes will not open there.
func (f *FS) mountPaths(onMount map[uint64][]*inode) []mountPath {
	root, rootOK := f.rootLink()
	var out []mountPath
	for mnt, inodes := range onMount {
		if mnt == f.root.key.mntID {
			out = append(out, mountPath{MountID: mnt, Path: "."})
			continue
		}
		p, ok := "", false
		if rootOK {
			// Directories first: the shortest path is the likeliest
			// mount point.
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
		}
		if !ok {
			slog.Warn("passthrough: migration: no path in the share for a mount; its inodes cannot be opened by a destination",
				"mount_id", mnt, "inodes", len(inodes))
			continue
		}
		out = append(out, mountPath{MountID: mnt, Path: p})
	}
	slices.SortFunc(out, func(a, b mountPath) int { return cmpU64(a.MountID, b.MountID) })
	return out
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

// --- destination: LoadState ---

// LoadState reads a state from r, to end of stream: one this daemon or the
// Rust virtiofsd wrote (stateenc.go). It decodes and validates the whole
// stream, then calls restore with the FUSE server's session record the
// stream carried (nil for a stream without our trailer, i.e. from the Rust
// daemon), whether the guest had a session (the state has a root), and the
// negotiated options of the Rust format as gofuse.CAP_* bits
// (WRITEBACK_CACHE, SUBMOUNTS, POSIX_ACL with DONT_MASK and SETXATTR_EXT,
// CREATE_SUPP_GROUP). restore returns the capabilities of the session to
// install, as Init(caps) would, or an error. Then LoadState reopens every
// inode and handle and replaces whatever the FS held; without a session it
// ends the FS's, as Destroy does. On error nothing is installed and every fd
// opened meanwhile is closed. Call it with no request running.
func (f *FS) LoadState(r io.Reader, restore func(session []byte, mounted bool, negotiated uint64) (caps uint64, err error)) error {
	s, err := decodeState(r, maxStateSize)
	if err != nil {
		return err
	}
	plan, err := s.validate()
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
	mounted := plan.root >= 0
	caps, err := restore(session, mounted, s.Opts.caps())
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

// caps is the negotiated options as the capabilities that turn them on.
func (o negotiatedOpts) caps() uint64 {
	var c uint64
	if o.Writeback {
		c |= gofuse.CAP_WRITEBACK_CACHE
	}
	if o.AnnounceSubmounts {
		c |= gofuse.CAP_SUBMOUNTS
	}
	if o.PosixACL {
		c |= gofuse.CAP_POSIX_ACL | gofuse.CAP_DONT_MASK | gofuse.CAP_SETXATTR_EXT
	}
	if o.SuppGroups {
		c |= gofuse.CAP_CREATE_SUPP_GROUP
	}
	return c
}

// checkNegotiated refuses, as the Rust daemon does, a state whose source
// had writeback, announce_submounts or POSIX ACLs on when they are off
// here: the guest relies on them and would send no new INIT to learn
// otherwise. A Rust source with --security-label had the guest negotiate
// FUSE_SECURITY_CTX, whose request extension this daemon does not parse.
func (f *FS) checkNegotiated(s *migState) error {
	o := &f.opts
	switch {
	case s.Opts.Writeback && !o.Writeback:
		return fmt.Errorf("the migration source has the writeback cache on; it is off here (--writeback)")
	case s.Opts.AnnounceSubmounts && !o.AnnounceSubmounts:
		return fmt.Errorf("the migration source announces submounts; that is off here (--no-announce-submounts)")
	case s.Opts.PosixACL && !o.PosixACL:
		return fmt.Errorf("the migration source has POSIX ACLs on; they are off here (--posix-acl)")
	case !s.Ours && o.SecurityLabel && len(s.Inodes) > 0:
		return fmt.Errorf("a Rust virtiofsd session with --security-label negotiated FUSE_SECURITY_CTX, which this daemon does not serve")
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

// stage reopens every record. Unreachable objects follow
// Options.Migration.OnError.
func (f *FS) stage(s *migState, plan *loadPlan, caps uint64) (_ *staged, err error) {
	st := &staged{inodes: make([]*inode, 0, len(s.Inodes)), handles: make([]*handle, 0, len(s.Handles))}
	mounts := &mountFDs{f: f, paths: s.MountPaths}
	defer mounts.close()
	defer func() {
		if err != nil {
			st.release()
		}
	}()
	if r := &s.Inodes[plan.root]; r.Verify != nil {
		// Another shared directory than the source's is a
		// configuration error, whatever OnError says.
		if why := f.sameHandle(f.root, r.Verify); why != "" {
			return nil, fmt.Errorf("migration: the shared directory is not the source's: %s", why)
		}
	}
	abort := f.opts.Migration.OnError == MigrationAbort
	all := make([]*inode, len(s.Inodes))
	keys := make(map[inodeKey]uint64, len(s.Inodes)+1)
	keys[f.root.key] = rootID
	for _, k := range plan.order {
		r := &s.Inodes[k]
		i, why, e := f.reopenInode(r, plan, all, mounts)
		if outOfResources(e) {
			if i != nil {
				i.put()
			}
			return nil, fmt.Errorf("migration: node %#x (%s): %s", r.ID, r.where(), why)
		}
		if i != nil && r.Verify != nil {
			if why = f.sameHandle(i, r.Verify); why != "" {
				i.put()
				i = nil
			}
		}
		lookups := plan.lookups[k]
		if i != nil && lookups > 0 {
			if other, dup := keys[i.key]; dup {
				i.put()
				i, why = nil, fmt.Sprintf("opens as the object of node %#x", other)
			}
		}
		if i == nil {
			if lookups == 0 {
				// Only on its children's paths: they will say.
				continue
			}
			if abort {
				return nil, fmt.Errorf("migration: node %#x (%s): %s", r.ID, r.where(), why)
			}
			slog.Warn("passthrough: migration: inode restored stale", "node", r.ID, "location", r.where(), "why", why)
			i = &inode{key: inodeKey{ino: r.ID, stale: true}, fd: -1, ftype: r.Type, stale: true, fs: f}
			i.refs.Store(1)
		}
		i.id, i.nlookup = r.ID, lookups
		all[k] = i
		if lookups == 0 {
			st.paths = append(st.paths, i)
			continue
		}
		keys[i.key] = r.ID
		st.inodes = append(st.inodes, i)
	}
	writeback := caps&gofuse.CAP_WRITEBACK_CACHE != 0
	for k := range s.Handles {
		r := &s.Handles[k]
		i := f.root
		if r.Inode != rootID {
			i = all[plan.index[r.Inode]] // validate: present, with lookups, so staged
		}
		dir := r.isDir()
		h := &handle{id: r.ID, fd: -1, ino: i, flags: int(r.hostFlags()), wait: bufvec.MayWait}
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
			h.fd, h.flags, why, e = f.reopenHandle(i, dir, r.hostFlags(), writeback)
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
			if !dir {
				h.wait = i.fileWait(h.fd)
			}
		}
		i.refs.Add(1) // the handle's reference
		h.refs.Store(1)
		st.handles = append(st.handles, h)
	}
	// The inodes only their children needed go now.
	for _, i := range st.paths {
		i.put()
	}
	st.paths = nil
	return st, nil
}

// where describes a record's location for logs and errors.
func (r *inodeRecord) where() string {
	switch {
	case r.RawPath != "":
		return fmt.Sprintf("path %q", r.RawPath)
	case r.Loc == locFullPath:
		return fmt.Sprintf("path %q", r.Path)
	case r.Loc == locPath:
		return fmt.Sprintf("%q below node %#x", r.Path, r.Parent)
	case r.Loc == locFileHandle:
		return fmt.Sprintf("file handle of type %#x on mount %d", r.Handle.Type, r.Handle.MountID)
	}
	return "invalid on the source"
}

// hostFlags is the host open flags to reopen a handle with, before
// hostOpenFlagsWB: ours from the trailer, else the Rust daemon's (guest)
// flags, which hostOpenFlagsWB turns into ours.
func (h *handleRecord) hostFlags() uint32 {
	if h.Known {
		return h.HostFlags
	}
	return uint32(h.Flags)
}

// outOfResources tells the errors of this daemon's limits (fds, memory)
// from those of the object: they fail a load whatever OnError says, since
// the object itself may be fine.
func outOfResources(e syscall.Errno) bool {
	return e == syscall.EMFILE || e == syscall.ENFILE || e == syscall.ENOMEM
}

// reopenInode opens r as its location says and makes an inode of it (nil,
// why not and the errno when it does not open, or opens as another type
// than the trailer says). all holds the inodes staged so far, by record.
func (f *FS) reopenInode(r *inodeRecord, plan *loadPlan, all []*inode, mounts *mountFDs) (*inode, string, syscall.Errno) {
	var fd int
	var e syscall.Errno
	switch {
	case r.RawPath != "":
		fd, e = f.openBeneath(r.RawPath)
	case r.Loc == locFullPath:
		fd, e = f.openBeneath(r.Path)
	case r.Loc == locPath:
		parent := f.root
		if r.Parent != rootID {
			parent = all[plan.parent[plan.index[r.ID]]]
		}
		if parent == nil || parent.stale {
			return nil, fmt.Sprintf("its parent %#x is unreachable", r.Parent), 0
		}
		if !parent.isDir() {
			return nil, fmt.Sprintf("its parent %#x is not a directory", r.Parent), 0
		}
		p, pe := f.pathOf(parent)
		if pe != 0 {
			return nil, "parent: " + pe.Error(), pe
		}
		fd, e = f.openBeneathAt(p.fd, r.Path)
		p.put()
	case r.Loc == locFileHandle:
		var why string
		fd, why, e = f.openHandleRecord(&r.Handle, mounts)
		if fd < 0 {
			return nil, why, e
		}
	default:
		return nil, "unreachable on the source", 0
	}
	if e != 0 {
		return nil, "open: " + e.Error(), e
	}
	var sx unix.Statx_t
	if e := statxFD(fd, &sx); e != 0 {
		f.closeInodeFD(fd)
		return nil, "statx: " + e.Error(), e
	}
	if t := uint32(sx.Mode) & unix.S_IFMT; r.Type != 0 && t != r.Type {
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

// sameHandle compares i's file handle with the source's reference (type
// and bytes: mount ids differ between hosts) and says how they differ.
func (f *FS) sameHandle(i *inode, ref *fileHandleRecord) string {
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
	paths []mountPath
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
	k := slices.IndexFunc(m.paths, func(p mountPath) bool { return p.MountID == id })
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
		slog.Warn("passthrough: migration: cannot open a mount of the source's file handles", "mount_id", id,
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
	pfd := f.root.fd
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
// CAP_DAC_READ_SEARCH. An object a path shows outside the shared directory
// is refused; one without a path there (unlinked on the host, or not in
// the dentry cache) cannot be told apart from one in the share: file
// handles trust the source, as in the Rust daemon.
func (f *FS) openHandleRecord(h *fileHandleRecord, mounts *mountFDs) (int, string, syscall.Errno) {
	mfd, why, e := mounts.get(h.MountID)
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
	if root, ok := f.rootLink(); ok && root != "/" {
		if link, ok := f.fdLink(fd); ok && strings.HasPrefix(link, "/") && !strings.HasSuffix(link, " (deleted)") &&
			link != root && !strings.HasPrefix(link, root+"/") {
			f.closeInodeFD(fd)
			return -1, "the file handle opens an object outside the shared directory", 0
		}
	}
	return fd, "", 0
}

// reopenHandle opens i for a handle as OPEN (or OPENDIR) would: through
// /proc/self/fd, only regular files and directories. flags are host open
// flags (hostFlags). It returns the fd and host flags, or -1, why not and
// the errno.
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
		ok := ks.m[i.key] == nil
		if ok {
			if f.nodes.restore(i.id, i, limit) {
				overNodes++
			}
			ks.m[i.key] = i
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
		slog.Info("passthrough: migration: ids this daemon would not issue are kept aside",
			"node_ids", overNodes, "file_handles", overHandles)
	}
	return nil
}
