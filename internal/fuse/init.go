package fuse

import (
	"strconv"
	"syscall"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// serverCaps are the capabilities the server asks for whenever the guest
// offers them, whatever the file system wants: they concern the protocol,
// not the file system's semantics. ALLOW_IDMAP lets the guest make
// idmapped mounts of the share: requests that create nothing then carry
// uid and gid FUSE_INVALID_UIDGID, and creations the ids as mapped by the
// mount, which the file system takes as any caller's (FileSystem).
const serverCaps = gofuse.CAP_ASYNC_READ | gofuse.CAP_BIG_WRITES | gofuse.CAP_MAX_PAGES |
	gofuse.CAP_PARALLEL_DIROPS | gofuse.CAP_ASYNC_DIO | gofuse.CAP_INIT_EXT | gofuse.CAP_ALLOW_IDMAP

// allowedCaps are the capabilities of protocol 7.45 the server can handle at
// all. Left out of the 32 flags: the splice bits (meaningless here),
// IOCTL_DIR (IOCTL is ENOSYS), bit 31 (reserved); MAP_ALIGNMENT is
// added apart, with a DAX window only (dax.go). Of flags2, what 7.36 to
// 7.45 added, one by one:
//
//   - SECURITY_CTX (bit 32): its request extension (a security context to
//     create with) is parsed (secctx.go) and handed to the file system,
//     which decides whether to negotiate it (--security-label).
//   - HAS_INODE_DAX (33): added apart, with a DAX window only (dax.go):
//     the file system then marks files FUSE_ATTR_DAX (dax=inode).
//   - CREATE_SUPP_GROUP (34): its extension is parsed (ext.go) and handed
//     to the file system.
//   - HAS_EXPIRE_ONLY (35): the kernel's, for notifications.
//   - DIRECT_IO_ALLOW_MMAP (36, 7.39): the file system's choice.
//   - PASSTHROUGH (37, 7.40): backing files registered through /dev/fuse
//     ioctls; a virtio-fs guest has none to call (and never offers it).
//   - NO_EXPORT_SUPPORT (38, 7.40): the server would say the mount cannot
//     be exported (name_to_handle_at and NFS): this one can, it answers
//     the LOOKUPs of "." and ".." that EXPORT_SUPPORT needs. Never asked
//     for.
//   - HAS_RESEND (39, 7.40): the server could send FUSE_NOTIFY_RESEND,
//     which makes the kernel queue every pending request again (for a
//     /dev/fuse server that restarted and lost them). No notification
//     reaches a virtio-fs guest (VIRTIO_FS_F_NOTIFICATION is never
//     acked), and requests a restarted back end lost are the vhost-user
//     inflight area's business: never negotiated.
//   - ALLOW_IDMAP (40, 7.41): negotiated whenever offered (serverCaps).
//   - OVER_IO_URING (41, 7.42): a /dev/fuse transport; never offered by a
//     virtio-fs guest, never negotiated.
//   - REQUEST_TIMEOUT (42, 7.43): with it the guest aborts the whole
//     connection (every later request fails with ENOTCONN until the
//     mount is remade) when one request outlives init_out.request_timeout
//     seconds; a slow host disk or a blocking SETLKW would then kill the
//     guest's file system. Never negotiated (request_timeout stays 0).
//
// 7.44's NOTIFY_INC_EPOCH and 7.45's NOTIFY_PRUNE are notifications the
// server never sends (none reaches a virtio-fs guest); 7.39's STATX and
// 7.45's COPY_FILE_RANGE_64 are opcodes (opcode.go).
const allowedCaps = flagsBits&^deniedCaps | gofuse.CAP_HAS_EXPIRE_ONLY | gofuse.CAP_DIRECT_IO_ALLOW_MMAP |
	gofuse.CAP_CREATE_SUPP_GROUP | gofuse.CAP_ALLOW_IDMAP | gofuse.CAP_SECURITY_CTX

// Negotiator is a FileSystem that has the last word on INIT: given what
// the guest offers and what the server would answer, it returns the
// answer (a subset), or an error to refuse the session (a feature it was
// told to require that the guest does not offer): INIT then fails with
// EPROTO, and the guest's mount with it, and a previous session ends.
type Negotiator interface {
	Negotiate(offered, caps uint64) (uint64, error)
}

const (
	flagsBits  = uint64(1)<<31 - 1
	deniedCaps = gofuse.CAP_SPLICE_WRITE | gofuse.CAP_SPLICE_MOVE | gofuse.CAP_SPLICE_READ |
		gofuse.CAP_IOCTL_DIR | gofuse.CAP_MAP_ALIGNMENT
)

func (q *Queue) doInit(_, _ *bufvec.Vec) syscall.Errno {
	a, o := argsOf[gofuse.InitIn](q), replyOf[gofuse.InitOut](q)
	switch {
	case a.Major > KernelVersion:
		// The guest sends INIT again with our major version.
		o.Major, o.Minor = KernelVersion, KernelMinor
		return 0
	case a.Major < KernelVersion || a.Minor < MinKernelMinor:
		if q.rateLimit() {
			q.s.log.Warn("unsupported FUSE protocol version", "queue", q.index,
				"major", a.Major, "minor", a.Minor, "need", versionString(KernelVersion, MinKernelMinor))
		}
		return syscall.EPROTO
	}
	offered := uint64(a.Flags)
	if a.Flags&gofuse.CAP_INIT_EXT != 0 {
		offered |= uint64(a.Flags2) << 32
	}
	caps := offered & (q.s.fs.Capabilities() | serverCaps) & allowedCaps
	// DAX: MAP_ALIGNMENT and HAS_INODE_DAX only with a window, and only
	// when the guest offers them (dax.go).
	window := q.s.windowSize()
	if window != 0 {
		caps |= offered & daxCaps
	}
	if n, ok := q.s.fs.(Negotiator); ok {
		c, err := n.Negotiate(offered, caps)
		if err != nil {
			// The guest starts anew: a previous session ends here too.
			q.s.log.Error("FUSE INIT refused", "queue", q.index, "err", err)
			q.doDestroy(nil, nil)
			return syscall.EPROTO
		}
		caps &= c
	}
	minor := min(a.Minor, KernelMinor)

	o.Major = KernelVersion
	o.Minor = minor
	o.MaxReadAhead = a.MaxReadAhead
	o.Flags = uint32(caps)
	o.Flags2 = uint32(caps >> 32) // non-zero only with INIT_EXT
	o.MaxBackground = q.s.opts.MaxBackground
	o.CongestionThreshold = q.s.opts.CongestionThreshold
	o.MaxWrite = q.s.opts.MaxWrite
	o.TimeGran = 1
	if caps&gofuse.CAP_MAX_PAGES != 0 {
		o.MaxPages = q.s.opts.MaxPages
	}
	if caps&gofuse.CAP_MAP_ALIGNMENT != 0 {
		o.MapAlignment = MapAlignment
	}

	// A second INIT (guest reboot or driver reset) or INIT after
	// DESTROY starts a new session: the file system drops the old one.
	s := q.s
	s.mu.Lock()
	s.sess.Store(nil)
	s.fs.Init(caps)
	s.sess.Store(&session{minor: minor, caps: caps, maxWrite: o.MaxWrite, maxPages: o.MaxPages,
		maxReadahead: o.MaxReadAhead, window: window})
	s.mu.Unlock()
	s.log.Info("FUSE session started", "queue", q.index, "client", versionString(a.Major, a.Minor),
		"negotiated", versionString(KernelVersion, minor), "flags", caps, "max_write", o.MaxWrite,
		"max_readahead", o.MaxReadAhead)
	return 0
}

func (q *Queue) doDestroy(_, _ *bufvec.Vec) syscall.Errno {
	s := q.s
	s.mu.Lock()
	s.sess.Store(nil)
	s.fs.Destroy()
	s.mu.Unlock()
	s.log.Info("FUSE session ended", "queue", q.index)
	return 0
}

func versionString(major, minor uint32) string {
	return strconv.FormatUint(uint64(major), 10) + "." + strconv.FormatUint(uint64(minor), 10)
}
