package passthrough

import (
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// credPool runs the operations that create objects (MKNOD, MKDIR, SYMLINK,
// CREATE, TMPFILE) with the guest caller's fsuid and fsgid, as DESIGN §4
// says, on a few dedicated goroutines that each lock an OS thread for good:
//
//   - fsuid/fsgid are per thread on Linux; a worker switches them with
//     setfsgid then setfsuid, reads each back (setfsuid returns the previous
//     value, not failure), runs the operation and restores them. If
//     restoring fails the worker exits without unlocking its thread, so the
//     Go runtime destroys the thread and a fresh worker replaces it.
//   - the supplementary groups the guest sent with the request
//     (CREATE_SUPP_GROUP: the caller may create in the directory only
//     through one of them; Linux sends one, at most maxGroups are taken)
//     are set for the operation with the raw setgroups system call, which
//     changes only the calling thread (glibc's and Go's Setgroups change
//     every thread), and dropped again after it, as the
//     Rust virtiofsd does. Without it the switched fsuid has no group
//     access the guest granted (the daemon dropped its own groups at
//     start, CVE-2022-0358).
//   - each worker thread unshares CLONE_FS, so its umask (0, or the
//     guest's umask when FUSE_DONT_MASK is negotiated for POSIX ACLs) and
//     its cwd are its own. The cwd is /proc/self/fd: path-based xattr calls
//     on symlinks and special files (which cannot be opened) use the fd
//     number as a relative name there, without the C daemon's
//     process-wide fchdir.
//
// Everything else runs on the calling goroutine with the daemon's
// credentials. The workers start on first use, i.e. after any sandbox set-up.
type credPool struct {
	f       *FS
	once    sync.Once
	jobs    chan *credJob
	quit    chan struct{}
	shared  atomic.Bool // unshare(CLONE_FS) failed: umask/cwd are process-wide
	switchc bool        // the daemon may switch credentials (euid 0)
	euid    uint32      // the daemon's ids, which a switch would restore
	egid    uint32
	workers int
	mu      sync.Mutex // serialises jobs when !unshared

	groupWarned atomic.Bool
}

type credJob struct {
	uid, gid uint32
	groups   [maxGroups]uint32 // supplementary groups, the first ngroups
	ngroups  int
	umask    int  // -1: 0
	switchID bool // switch fsuid/fsgid
	needCwd  bool // fn uses the worker's cwd (/proc/self/fd)
	fn       func() syscall.Errno
	done     chan syscall.Errno
}

func (p *credPool) init(f *FS) {
	p.f = f
	p.jobs = make(chan *credJob)
	p.quit = make(chan struct{})
	p.switchc = unix.Geteuid() == 0
	p.euid, p.egid = uint32(unix.Geteuid()), uint32(unix.Getegid())
	p.workers = max(2, min(runtime.GOMAXPROCS(0), 8))
}

func (p *credPool) start() {
	p.once.Do(func() {
		for range p.workers {
			go p.worker()
		}
	})
}

func (p *credPool) stop() {
	select {
	case <-p.quit:
	default:
		close(p.quit)
	}
}

func (p *credPool) worker() {
	runtime.LockOSThread()
	// Never unlocked: the thread's fs_struct is private.
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		if !p.shared.Swap(true) {
			p.f.log.Warn("passthrough: unshare(CLONE_FS) failed; creation requests are serialised and umask is process-wide", "err", err)
		}
	} else {
		unix.Umask(0)
		unix.Fchdir(p.f.procSelfFD)
	}
	for {
		select {
		case <-p.quit:
			return
		case j := <-p.jobs:
			ok := p.do(j)
			if !ok {
				// Thread left with foreign credentials: let it die.
				go p.worker()
				return
			}
		}
	}
}

// do runs one job; it returns false when the thread's credentials could not
// be restored.
func (p *credPool) do(j *credJob) bool {
	restoreOK := true
	var errno syscall.Errno
	if p.shared.Load() {
		if j.needCwd {
			j.done <- syscall.ENOTSUP
			return true
		}
		p.mu.Lock()
		defer p.mu.Unlock()
		old := unix.Umask(max(j.umask, 0))
		defer unix.Umask(old)
	} else if j.umask >= 0 {
		unix.Umask(j.umask)
		defer unix.Umask(0)
	}
	if j.switchID {
		grouped := j.ngroups > 0 && p.setGroups(j.groups[:j.ngroups])
		var prevUID, prevGID int
		prevUID, prevGID, errno = switchCreds(j.uid, j.gid)
		if errno == 0 {
			errno = j.fn()
		}
		restoreOK = p.restoreCreds(prevUID, prevGID)
		if grouped && !p.dropGroups() {
			restoreOK = false
		}
	} else {
		errno = j.fn()
	}
	j.done <- errno
	return restoreOK
}

// switchCreds sets fsgid then fsuid and verifies both took.
func switchCreds(uid, gid uint32) (prevUID, prevGID int, errno syscall.Errno) {
	prevGID, _ = unix.SetfsgidRetGid(int(gid))
	prevUID = -1
	if cur, _ := unix.SetfsgidRetGid(-1); cur != int(gid) {
		return -1, prevGID, syscall.EPERM
	}
	prevUID, _ = unix.SetfsuidRetUid(int(uid))
	if cur, _ := unix.SetfsuidRetUid(-1); cur != int(uid) {
		return prevUID, prevGID, syscall.EPERM
	}
	return prevUID, prevGID, 0
}

// maxGroups is internal/fuse.MaxGroups: the most supplementary groups one
// creation request carries.
const maxGroups = 32

// setGroups makes gs this thread's supplementary groups. A failure (a
// user namespace whose setgroups is denied) is logged once; the operation
// then runs without the groups, as it did before the guest could send them.
func (p *credPool) setGroups(gs []uint32) bool {
	if _, _, e := unix.RawSyscall(unix.SYS_SETGROUPS, uintptr(len(gs)), uintptr(unsafe.Pointer(&gs[0])), 0); e != 0 {
		if !p.groupWarned.Swap(true) {
			p.f.log.Warn("passthrough: cannot set supplementary groups for a creation request; creating without them", "err", e)
		}
		return false
	}
	return true
}

// dropGroups clears this thread's supplementary groups again.
func (p *credPool) dropGroups() bool {
	if _, _, e := unix.RawSyscall(unix.SYS_SETGROUPS, 0, 0, 0); e != 0 {
		p.f.log.Error("passthrough: could not drop a supplementary group; retiring the thread", "err", e)
		return false
	}
	return true
}

// restoreCreds gives this thread the daemon's fsuid/fsgid back.
func (p *credPool) restoreCreds(prevUID, prevGID int) bool {
	ok := true
	if prevUID >= 0 {
		unix.SetfsuidRetUid(prevUID)
		if cur, _ := unix.SetfsuidRetUid(-1); cur != prevUID {
			ok = false
		}
	}
	if prevGID >= 0 {
		unix.SetfsgidRetGid(prevGID)
		if cur, _ := unix.SetfsgidRetGid(-1); cur != prevGID {
			ok = false
		}
	}
	if !ok {
		p.f.log.Error("passthrough: could not restore fsuid/fsgid; retiring the thread")
	}
	return ok
}

// asCaller runs fn with the caller's fsuid/fsgid, supplementary groups
// (nil: none; at most maxGroups, else EINVAL) and umask (umask < 0: none)
// on a credential worker.
//
// When no switch is needed (the caller's ids are the daemon's, or the daemon
// cannot switch) and no umask applies, fn runs inline: the hand-off to a
// locked worker thread cost a CREATE more than its syscalls.
//
// uid, gid and groups are the guest's: with --translate-uid/--translate-gid
// they are mapped to host ids first, and a forbidden one fails with EPERM.
//
// A uid or gid FUSE_INVALID_UIDGID is no one's: the caller's ids did not
// map into the guest's FUSE user namespace (Linux refuses to send such a
// creation, EOVERFLOW), or the request is one that creates nothing and
// carries no ids (FUSE_ALLOW_IDMAP). It is never switched to, nor
// translated: EOVERFLOW, as the guest kernel would answer.
func (f *FS) asCaller(uid, gid uint32, groups []uint32, umask int, fn func() syscall.Errno) syscall.Errno {
	if uid == invalidUIDGID || gid == invalidUIDGID {
		return syscall.EOVERFLOW
	}
	if len(groups) > maxGroups {
		return syscall.EINVAL
	}
	var gs [maxGroups]uint32
	n := copy(gs[:], groups)
	if f.ids != nil {
		var errno syscall.Errno
		if uid, gid, errno = f.ids.toHost(uid, gid); errno != 0 {
			return errno
		}
		for i := range n {
			var ok bool
			if gs[i], ok = f.ids.gid.ToHost(gs[i]); !ok {
				return syscall.EPERM
			}
		}
	}
	p := &f.creds
	if umask < 0 && (!p.switchc || (uid == p.euid && gid == p.egid)) {
		return fn() // the process umask is 0 (New), the fs ids are ours
	}
	p.start()
	j := &credJob{uid: uid, gid: gid, groups: gs, ngroups: n, umask: umask, fn: fn, done: make(chan syscall.Errno, 1)}
	j.switchID = p.switchc
	select {
	case p.jobs <- j:
	case <-p.quit:
		return syscall.EIO
	}
	return <-j.done
}

// onWorker runs fn on a credential worker with the daemon's credentials
// (for calls that need the worker's cwd).
func (f *FS) onWorker(fn func() syscall.Errno) syscall.Errno {
	p := &f.creds
	p.start()
	j := &credJob{umask: -1, needCwd: true, fn: fn, done: make(chan syscall.Errno, 1)}
	select {
	case p.jobs <- j:
	case <-p.quit:
		return syscall.EIO
	}
	return <-j.done
}

// umaskFor returns the umask to apply for a creation request: the guest's
// when it sends unmasked modes (FUSE_DONT_MASK), else none.
func (f *FS) umaskFor(umask uint32) int {
	if f.dontMask.Load() {
		return int(umask & 0o777)
	}
	return -1
}
