package fuse

import (
	"strconv"
	"syscall"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// serverCaps are the capabilities the server asks for whenever the guest
// offers them, whatever the file system wants: they concern the protocol,
// not the file system's semantics.
const serverCaps = gofuse.CAP_ASYNC_READ | gofuse.CAP_BIG_WRITES | gofuse.CAP_MAX_PAGES |
	gofuse.CAP_PARALLEL_DIROPS | gofuse.CAP_ASYNC_DIO | gofuse.CAP_INIT_EXT

// allowedCaps are the capabilities of protocol 7.38 the server can handle at
// all. Left out: the splice bits (meaningless here), IOCTL_DIR (IOCTL is
// ENOSYS), MAP_ALIGNMENT and HAS_INODE_DAX (no DAX window), bit 31
// (reserved). The extensions of CREATE_SUPP_GROUP and SECURITY_CTX are
// parsed (ext.go, secctx.go) and handed to the file system.
const allowedCaps = flagsBits&^deniedCaps | gofuse.CAP_HAS_EXPIRE_ONLY | gofuse.CAP_DIRECT_IO_ALLOW_MMAP |
	gofuse.CAP_CREATE_SUPP_GROUP | gofuse.CAP_SECURITY_CTX

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
				"major", a.Major, "minor", a.Minor, "need", "7.27")
		}
		return syscall.EPROTO
	}
	offered := uint64(a.Flags)
	if a.Flags&gofuse.CAP_INIT_EXT != 0 {
		offered |= uint64(a.Flags2) << 32
	}
	caps := offered & (q.s.fs.Capabilities() | serverCaps) & allowedCaps
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

	// A second INIT (guest reboot or driver reset) or INIT after
	// DESTROY starts a new session: the file system drops the old one.
	s := q.s
	s.mu.Lock()
	s.sess.Store(nil)
	s.fs.Init(caps)
	s.sess.Store(&session{minor: minor, caps: caps, maxWrite: o.MaxWrite, maxPages: o.MaxPages,
		maxReadahead: o.MaxReadAhead})
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
