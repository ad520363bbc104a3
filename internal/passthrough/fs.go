// Package passthrough is the host side of govirtiofsd: a FUSE file system
// that mirrors one host directory tree to the guest.
//
// It owns everything that touches the host file system on the guest's
// behalf: the inode table (host objects keyed by device, inode number and
// mount id, held as O_PATH fds or file handles and refcounted by the
// guest's lookup count; fds within a budget, past which unused ones are
// evicted and reopened by name: budget.go, names.go; a few directories
// held by handle keep an fd: dircache.go), the handle table of
// open files and directories, the validation of every name and id the
// guest sends, the credentials used to create objects, kill-priv handling,
// cache-mode timeouts and open flags, locks, and the live migration of all that: collecting a way to each inode, saving the
// tables and reopening them on a destination (collect.go, save.go,
// load.go; the state's records and stream are package migstate's).
//
// The rules, from DESIGN §4 and the C and Rust daemons' CVEs:
//   - no host path strings: every object is reached from its parent's fd
//     with one *at call per validated component (O_NOFOLLOW, openat2
//     RESOLVE_BENEATH|RESOLVE_NO_MAGICLINKS|RESOLVE_NO_SYMLINKS; a LOOKUP
//     in handle mode stats and encodes the one component without opening
//     it, following no symlink), and O_PATH fds are reopened through an fd
//     of /proc/self/fd taken at start;
//   - only regular files and directories are ever opened (CVE-2020-35517);
//   - objects are created with the guest caller's fsuid/fsgid on a
//     dedicated thread, with supplementary groups dropped (CVE-2022-0358);
//     every other operation runs with the daemon's credentials;
//   - guest-controlled ids are generation-checked table indexes, never
//     pointers; an unknown id is EBADF, never a crash.
//
// FS satisfies internal/fuse.FileSystem structurally; this package does
// not import internal/fuse.
package passthrough

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// rootID is FUSE_ROOT_ID.
const rootID = 1

// invalidUIDGID is FUSE_INVALID_UIDGID, the uid and gid of a request that
// carries no caller ids.
const invalidUIDGID = ^uint32(0)

// FS is the passthrough file system.
type FS struct {
	opts Options
	ids  *idMaps // nil unless an id translation was given
	log  *slog.Logger

	procSelfFD int // O_PATH fd of /proc/self/fd
	root       *inode

	nodes   slotTable[inode, *inode]
	handles slotTable[handle, *handle]
	keys    [keyShards]keyShard
	rr      atomic.Uint32 // round robin for handle shards

	entryTimeout time.Duration
	attrTimeout  time.Duration

	// Negotiated at INIT.
	sessionMu  sync.Mutex
	initDone   bool
	caps       atomic.Uint64
	writeback  atomic.Bool
	dontMask   atomic.Bool
	submounts  atomic.Bool
	killprivV2 atomic.Bool

	openat2 atomic.Bool // openat2 available

	useHandles bool // inodes are held as file handles where their mount allows
	mountsMu   sync.Mutex
	mounts     map[uint64]*mountFD
	// mountModes holds, per mount id, whether its objects are held by
	// handle (handles.go): replaced whole under mountsMu, read without.
	mountModes atomic.Pointer[map[uint64]bool]
	xmap       *xattrMap

	creds     credPool
	closeOnce sync.Once

	locks    atomic.Int64 // lock owner fds held
	maxLocks int64

	mig migration

	// fd accounting (for tests and metrics)
	inodeFDs  atomic.Int64
	handleFDs atomic.Int64

	// The fd budget (budget.go).
	budget        int64
	dirs          dirCache     // fds of directories held by handle (dircache.go)
	residentFDs   atomic.Int64 // resident fds of fd-held inodes, the root's aside
	evictedNow    atomic.Int64 // fd-held inodes without a resident fd
	reopens       atomic.Uint64
	estales       atomic.Uint64
	sweepAgainAt  atomic.Int64 // resident fds at which a futile sweep is worth retrying; 0: now
	evictMu       sync.Mutex   // one sweep at a time; guards the fields below
	hand          uint32
	budgetWarned  bool
	noFID         map[uint64]bool // mounts without AT_HANDLE_FID
	fdLimitWarned atomic.Bool
	fdHeld        atomic.Bool    // some inode was held by fd: names may be tracked
	track         atomic.Uint32  // untracked, namingPass or tracked (names.go)
	naming        sync.WaitGroup // startTracking's pass
	nameInline    bool           // tests: startTracking's pass runs before it returns
	closing       atomic.Bool
	// namesMu orders the guest's renames and unlinks (writers) against
	// reopen walks (readers) of inode names.
	namesMu sync.RWMutex

	dax daxTable // the DAX window's mappings (dax.go)
}

// New opens root (O_PATH) and returns a file system serving it. log (not
// nil) receives what the file system has to say: a feature unusable here,
// a credential switch that failed, a migration's progress and what it
// could not carry.
func New(root string, opts Options, log *slog.Logger) (*FS, error) {
	if log == nil {
		return nil, fmt.Errorf("passthrough: no logger")
	}
	if opts.PosixACL && !opts.Xattr {
		return nil, fmt.Errorf("posix ACLs need xattr support")
	}
	if m := &opts.Migration; m.Mode == MigrationFileHandles && (m.ConfirmPaths || m.VerifyHandles) {
		// As the Rust daemon: with file handles there is no path to
		// confirm and nothing to verify.
		return nil, fmt.Errorf("migration path confirmation and handle verification apply to find-paths mode only")
	}
	if err := checkInodeDAX(opts.InodeDAX); err != nil {
		return nil, err
	}
	f := &FS{opts: opts, log: log, procSelfFD: -1, budget: fdBudget(&opts)}
	f.SetWindow(opts.Window)
	f.dirs.slots = make([]*inode, 0, dirCacheSize(f.budget))
	xm, err := parseXattrMap(opts.XattrMap)
	if err != nil {
		return nil, err
	}
	f.xmap = xm
	if opts.TranslateUID != nil || opts.TranslateGID != nil {
		f.ids = &idMaps{uid: opts.TranslateUID, gid: opts.TranslateGID}
	}
	f.maxLocks = int64(opts.MaxLocks)
	if f.maxLocks <= 0 {
		f.maxLocks = 4096
	}
	switch opts.Cache {
	case CacheNever:
		f.entryTimeout, f.attrTimeout = 0, 0
	case CacheAuto:
		f.entryTimeout, f.attrTimeout = time.Second, time.Second
	default:
		f.entryTimeout, f.attrTimeout = 24*time.Hour, 24*time.Hour
	}
	if opts.TimeoutSet {
		f.entryTimeout, f.attrTimeout = opts.Timeout, opts.Timeout
	}
	if err := f.openRoot(root); err != nil {
		return nil, err
	}
	f.creds.init(f)
	if !f.useHandles {
		f.log.Info("passthrough: inodes held by O_PATH fd, at most the budget of them resident", "inode_fd_budget", f.budget)
	}
	// Creation modes arrive already masked by the guest (FUSE_DONT_MASK
	// aside, handled per thread by the credential workers): the host must
	// not mask them again.
	unix.Umask(0)
	return f, nil
}

// openRoot opens /proc/self/fd and the shared directory, makes the root
// inode (held by file handle if the options ask for it and the file
// system gives one) and probes openat2.
func (f *FS) openRoot(root string) (err error) {
	var proc int
	if f.opts.ProcSelfFD != nil {
		proc, err = unix.FcntlInt(f.opts.ProcSelfFD.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	} else {
		proc, err = unix.Open("/proc/self/fd", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	}
	if err != nil {
		return fmt.Errorf("open /proc/self/fd: %w", err)
	}
	f.procSelfFD = proc
	rfd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		unix.Close(proc)
		return fmt.Errorf("open shared directory: %w", err)
	}
	defer func() {
		if err != nil {
			unix.Close(rfd)
			unix.Close(proc)
		}
	}()
	var st unix.Statx_t
	if e := sysStatx(rfd, &emptyPath[0], unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW,
		unix.STATX_BASIC_STATS|unix.STATX_MNT_ID, &st); e != 0 {
		return fmt.Errorf("statx shared directory: %w", e)
	}
	if f.opts.Migration.Mode == MigrationFileHandles {
		// Refused now rather than failing the migration later.
		if _, err := nameToHandle(rfd); err != nil {
			return fmt.Errorf("--migration-mode file-handles: the shared directory's file system gives no file handles (name_to_handle_at: %w); use find-paths", err)
		}
	}
	f.inodeFDs.Add(1)
	f.root = &inode{id: rootID, key: keyOf(&st), ftype: unix.S_IFDIR, pinned: true, fs: f}
	f.root.ref.Store(residentWord(rfd) | 1)
	if f.opts.InodeFileHandles != FileHandlesNever {
		if err := f.useFileHandles(rfd); err != nil {
			return err
		}
	}
	f.keys[f.root.key.hash()%keyShards].add(f.root)

	// Probe openat2 (Linux 5.6+; a seccomp filter may also refuse it).
	how := unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC, Resolve: resolveFlags}
	if fd, e := sysOpenat2(rfd, &dotPath[0], &how); e == 0 {
		unix.Close(fd)
		f.openat2.Store(true)
	}
	return nil
}

// useFileHandles holds inodes by file handle (--inode-file-handles) where
// their mount allows it (handles.go); rfd is the shared directory's fd.
// Without the capability open_by_handle_at needs, no mount allows it: one
// line says so. The shared directory's own file system giving no handles
// decides its mount only: a submount may still (if the capability was not
// dropped at start for that very reason, as the sandbox does).
func (f *FS) useFileHandles(rfd int) error {
	h, err := probeHandles(rfd)
	mandatory := f.opts.InodeFileHandles == FileHandlesMandatory
	switch {
	case err == nil:
		f.useHandles = true
		f.mounts = make(map[uint64]*mountFD)
		f.root.key.handle = h
		f.setMountHandles(f.root.key.mntID, true, "", nil)
		// The shared directory's mount keeps its fd for good.
		if f.acquireMount(f.root.key.mntID, rfd) == nil {
			return fmt.Errorf("open shared directory for file handles failed")
		}
	case mandatory:
		return fmt.Errorf("inode file handles are mandatory but unusable: %w", err)
	case errors.Is(err, ErrHandlesNotPermitted):
		f.log.Info("passthrough: inode file handles not permitted: every inode is held as an O_PATH fd", "err", err)
	default:
		f.useHandles = true
		f.mounts = make(map[uint64]*mountFD)
		f.setMountHandles(f.root.key.mntID, false, "the shared directory's file system gives no file handles", err)
	}
	return nil
}

const resolveFlags = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_SYMLINKS

// Close releases every inode and handle and the root. The FS must not be
// used afterwards.
func (f *FS) Close() error {
	f.closing.Store(true)
	f.naming.Wait()
	f.stopCollecting(true)
	f.resetDAX(false)
	f.dax.watch.stop()
	f.reset()
	f.creds.stop()
	f.closeOnce.Do(func() {
		sysClose(f.root.residentFD())
		sysClose(f.procSelfFD)
	})
	return nil
}

// aclCaps are the capabilities POSIX ACLs need together: the guest
// enforces ACLs (POSIX_ACL), sends modes unmasked (DONT_MASK) and says
// when a SETXATTR of an ACL must clear SGID (SETXATTR_EXT).
const aclCaps = gofuse.CAP_POSIX_ACL | gofuse.CAP_DONT_MASK | gofuse.CAP_SETXATTR_EXT

// Negotiate completes INIT's answer (fuse.Negotiator), as the Rust
// virtiofsd 1.14 does: POSIX ACLs go on only if the guest offers all of
// aclCaps; a feature the options require (always) that the guest does not
// offer refuses the session, one they merely offer (auto) is left off.
func (f *FS) Negotiate(offered, caps uint64) (uint64, error) {
	o := &f.opts
	if o.PosixACL && offered&aclCaps != aclCaps {
		if o.RequirePosixACL {
			return 0, fmt.Errorf("--posix-acl=always: the guest does not offer FUSE_POSIX_ACL, DONT_MASK and SETXATTR_EXT (offered %#x)", offered)
		}
		f.log.Warn("POSIX ACLs asked for, but the guest does not support them: continuing without (--posix-acl=auto)")
		caps &^= aclCaps
	}
	if o.SecurityLabel && offered&gofuse.CAP_SECURITY_CTX == 0 {
		if o.RequireSecurityLabel {
			return 0, fmt.Errorf("--security-label=always: the guest does not offer FUSE_SECURITY_CTX")
		}
		f.log.Warn("security labels asked for, but the guest does not offer FUSE_SECURITY_CTX: continuing without (--security-label=auto)")
	}
	return caps, nil
}

// aclOn says whether the session negotiated POSIX ACLs: without, the
// guest enforces none, so their xattrs are refused and hidden.
func (f *FS) aclOn() bool { return f.caps.Load()&gofuse.CAP_POSIX_ACL != 0 }

// Capabilities returns the CAP_* bits the options call for.
func (f *FS) Capabilities() uint64 {
	c := uint64(gofuse.CAP_ASYNC_READ | gofuse.CAP_PARALLEL_DIROPS | gofuse.CAP_EXPORT_SUPPORT |
		gofuse.CAP_ATOMIC_O_TRUNC | gofuse.CAP_BIG_WRITES | gofuse.CAP_AUTO_INVAL_DATA |
		gofuse.CAP_ASYNC_DIO)
	o := &f.opts
	c |= optionCaps(o.Writeback, o.PosixACL, o.AnnounceSubmounts)
	if o.SecurityLabel {
		c |= gofuse.CAP_SECURITY_CTX
	}
	if o.KillprivV2 {
		c |= gofuse.CAP_HANDLE_KILLPRIV_V2
	}
	// Creation requests then carry the supplementary group through which
	// the caller may write the parent directory (asCaller).
	c |= gofuse.CAP_CREATE_SUPP_GROUP
	if !o.NoReaddirplus {
		c |= gofuse.CAP_READDIRPLUS | gofuse.CAP_READDIRPLUS_AUTO
	}
	if o.PosixLocks {
		c |= gofuse.CAP_POSIX_LOCKS
	}
	if o.Flock {
		c |= gofuse.CAP_FLOCK_LOCKS
	}
	return c
}

// optionCaps is the capabilities that turn on the writeback cache, POSIX
// ACLs and submount announcements: the options a migration carries
// (negotiatedCaps), which a destination must offer too.
func optionCaps(writeback, posixACL, submounts bool) uint64 {
	var c uint64
	if writeback {
		c |= gofuse.CAP_WRITEBACK_CACHE
	}
	if posixACL {
		c |= gofuse.CAP_POSIX_ACL | gofuse.CAP_DONT_MASK | gofuse.CAP_SETXATTR_EXT
	}
	if submounts {
		c |= gofuse.CAP_SUBMOUNTS
	}
	return c
}

// Init starts a session with the negotiated capabilities, first releasing
// everything a previous session held.
func (f *FS) Init(caps uint64) {
	f.sessionMu.Lock()
	defer f.sessionMu.Unlock()
	f.resetDAX(true)
	if f.initDone {
		f.reset()
	}
	f.setSession(caps)
}

// setSession records a session's capabilities (Init, LoadState). The
// caller holds sessionMu.
func (f *FS) setSession(caps uint64) {
	f.initDone = true
	f.caps.Store(caps)
	f.writeback.Store(caps&gofuse.CAP_WRITEBACK_CACHE != 0)
	f.dontMask.Store(caps&gofuse.CAP_DONT_MASK != 0)
	f.submounts.Store(f.opts.AnnounceSubmounts && caps&gofuse.CAP_SUBMOUNTS != 0)
	f.killprivV2.Store(caps&gofuse.CAP_HANDLE_KILLPRIV_V2 != 0)
}

// Destroy ends the session: every inode (but the root) and handle goes.
func (f *FS) Destroy() {
	f.sessionMu.Lock()
	defer f.sessionMu.Unlock()
	f.resetDAX(true)
	f.reset()
	f.initDone = false
}

// reset releases every handle and every inode but the root. Requests still
// running keep their objects alive through their own references.
func (f *FS) reset() {
	f.handles.drain(func(h *handle) { h.put() })
	var dead []*inode
	for si := range f.keys {
		ks := &f.keys[si]
		ks.mu.Lock()
		first := len(dead)
		ks.each(func(i *inode) {
			if !i.pinned {
				dead = append(dead, i)
			}
		})
		for _, i := range dead[first:] {
			ks.remove(i)
			i.nlookup = 0
			f.nodes.remove(i.id)
		}
		ks.mu.Unlock()
	}
	for _, i := range dead {
		i.put()
	}
	f.dropLocks(f.root) // lock owners on the root
}

// Stats reports how many inodes and handles the guest holds and how many
// fds they keep open.
type Stats struct {
	Inodes, Handles, InodeFDs, HandleFDs, LockFDs int
	// MapFDs are the fds DAX tails hold (dax.go).
	MapFDs int
}

// Stats returns the current table sizes.
func (f *FS) Stats() Stats {
	return Stats{
		Inodes:    f.nodes.len(),
		Handles:   f.handles.len(),
		InodeFDs:  int(f.inodeFDs.Load()),
		HandleFDs: int(f.handleFDs.Load()),
		LockFDs:   int(f.locks.Load()),
		MapFDs:    int(f.dax.fds.Load()),
	}
}

// BudgetStats reports the fd budget's work (budget.go): the budget, the
// inodes evicted now, the reopens so far and the reopens that answered
// ESTALE.
type BudgetStats struct {
	Budget, Evicted int
	Reopens, Stale  uint64
}

// BudgetStats returns the fd budget's figures, for metrics.
func (f *FS) BudgetStats() BudgetStats {
	return BudgetStats{
		Budget:  int(f.budget),
		Evicted: int(f.evictedNow.Load()),
		Reopens: f.reopens.Load(),
		Stale:   f.estales.Load(),
	}
}

// --- attributes and timeouts ---

func setTimeout(sec *uint64, nsec *uint32, d time.Duration) {
	*sec = uint64(d / time.Second)
	*nsec = uint32(d % time.Second)
}

func (f *FS) fillAttrOut(out *gofuse.AttrOut, st *syscall.Stat_t) {
	*out = gofuse.AttrOut{}
	out.Attr.FromStat(st)
	if f.ids != nil {
		f.ids.toGuest(&out.Attr.Uid, &out.Attr.Gid)
	}
	setTimeout(&out.AttrValid, &out.AttrValidNsec, f.attrTimeout)
}

// guestAttr fills a FUSE attr from a statx result, owners as the guest
// sees them (--translate-uid/--translate-gid).
func (f *FS) guestAttr(a *gofuse.Attr, st *unix.Statx_t) {
	attrFromStatx(a, st)
	if f.ids != nil {
		f.ids.toGuest(&a.Uid, &a.Gid)
	}
}

// attrFromStatx fills a FUSE attr from a statx result.
func attrFromStatx(a *gofuse.Attr, st *unix.Statx_t) {
	*a = gofuse.Attr{
		Ino:       st.Ino,
		Size:      st.Size,
		Blocks:    st.Blocks,
		Atime:     uint64(st.Atime.Sec),
		Atimensec: st.Atime.Nsec,
		Mtime:     uint64(st.Mtime.Sec),
		Mtimensec: st.Mtime.Nsec,
		Ctime:     uint64(st.Ctime.Sec),
		Ctimensec: st.Ctime.Nsec,
		Mode:      uint32(st.Mode),
		Nlink:     st.Nlink,
		Owner:     gofuse.Owner{Uid: st.Uid, Gid: st.Gid},
		Rdev:      newEncodeDev(st.Rdev_major, st.Rdev_minor),
		Blksize:   st.Blksize,
	}
}

// newEncodeDev is the kernel's new_encode_dev, the format of fuse_attr.rdev.
func newEncodeDev(major, minor uint32) uint32 {
	return (minor & 0xff) | (major&0xfff)<<8 | (minor&^0xff)<<12
}

func (f *FS) fillEntry(out *gofuse.EntryOut, i *inode, st *unix.Statx_t, parentMnt uint64) {
	*out = gofuse.EntryOut{NodeId: i.id}
	f.guestAttr(&out.Attr, st)
	if f.submounts.Load() && i.isDir() && st.Mnt_id != parentMnt {
		out.Attr.Flags |= gofuse.ATTR_SUBMOUNT
	}
	f.setAttrDAX(i, &out.Attr)
	setTimeout(&out.EntryValid, &out.EntryValidNsec, f.entryTimeout)
	setTimeout(&out.AttrValid, &out.AttrValidNsec, f.attrTimeout)
}

// fileOpenFlags returns FOPEN_* for a file handle per the cache mode.
func (f *FS) fileOpenFlags() uint32 {
	switch f.opts.Cache {
	case CacheNever, CacheMetadata:
		return gofuse.FOPEN_DIRECT_IO
	case CacheAlways:
		return gofuse.FOPEN_KEEP_CACHE
	}
	return 0
}

func (f *FS) dirOpenFlags() uint32 {
	if f.opts.Cache == CacheAlways {
		return gofuse.FOPEN_KEEP_CACHE | gofuse.FOPEN_CACHE_DIR
	}
	return 0
}

// DropSupplementaryGroups clears the process's supplementary groups
// (CVE-2022-0358: a setgid directory's group must not be granted to guest
// files through the daemon's own groups). Call it once at start; in Go it
// applies to every thread.
func DropSupplementaryGroups() error {
	if err := syscall.Setgroups([]int{}); err != nil {
		if err == syscall.EPERM {
			// Unprivileged without CAP_SETGID: fine if there are none.
			gs, gerr := syscall.Getgroups()
			if gerr == nil && (len(gs) == 0 || (len(gs) == 1 && gs[0] == syscall.Getegid())) {
				return nil
			}
		}
		return fmt.Errorf("setgroups: %w", err)
	}
	return nil
}

// RaiseNofileLimit raises RLIMIT_NOFILE to n (or as close as the hard limit
// and fs.nr_open allow) and returns the resulting soft limit.
func RaiseNofileLimit(n uint64) (uint64, error) {
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
		return 0, err
	}
	if b, err := os.ReadFile("/proc/sys/fs/nr_open"); err == nil {
		if nrOpen, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64); err == nil && n > nrOpen {
			n = nrOpen // the kernel's ceiling for RLIMIT_NOFILE
		}
	}
	if n <= rl.Cur {
		return rl.Cur, nil
	}
	want := unix.Rlimit{Cur: n, Max: max(n, rl.Max)}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &want); err == nil {
		return n, nil
	}
	// Could not raise the hard limit: go as high as it allows.
	want = unix.Rlimit{Cur: min(n, rl.Max), Max: rl.Max}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &want); err != nil {
		return rl.Cur, err
	}
	return want.Cur, nil
}

// SetNofileLimit sets RLIMIT_NOFILE to exactly n, soft and hard (an
// explicit --rlimit-nofile, which may also lower it).
func SetNofileLimit(n uint64) error {
	return unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: n, Max: n})
}

// OpenCounts reports the inodes the guest holds (the root included) and
// the open file and directory handles, for metrics.
func (f *FS) OpenCounts() (inodes, handles int) {
	return f.nodes.len() + 1, f.handles.len() // the root is not in the table
}
