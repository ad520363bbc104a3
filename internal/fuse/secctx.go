package fuse

import (
	"bytes"
	"encoding/binary"
	"syscall"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// SecCtx is the security context a creation request carries
// (FUSE_SECURITY_CTX): the xattr name an LSM labels new objects under
// ("security.selinux", "security.SMACK64", ...) and the label. Both point
// into per-queue scratch memory and must not be retained after the call.
// Name has no terminating NUL. An alias of an unnamed struct type, so
// that a file system declares the same type without importing this
// package (see FileSystem).
type SecCtx = struct {
	Name, Value []byte
}

// The security-context extension (Linux fs/fuse/dir.c,
// get_security_context), which takes the extension types 0..31:
//
//	fuse_secctx_header { u32 size; u32 nr_secctx }   the fuse_ext_header: size counts it, type is the count
//	nr_secctx times, each padded to 8 bytes:
//	  fuse_secctx { u32 size; u32 padding }   size: the label's length
//	  name, NUL-terminated
//	  label, size bytes
//
// A guest with no LSM that labels files (no SELinux, Smack, ...) sends the
// header alone, nr_secctx 0, with every creation; with one it sends one
// context. Linux never sends more than one.
const (
	maxSecCtxType  = 31    // FUSE_MAX_NR_SECCTX
	secCtxHdrSize  = 8     // fuse_secctx
	xattrNameMax   = 255   // XATTR_NAME_MAX
	xattrSizeMax   = 65536 // XATTR_SIZE_MAX
	secCtxBodyMax  = (secCtxHdrSize + xattrNameMax + 1 + xattrSizeMax + 7) &^ 7
	securityPrefix = "security."
)

// parseSecCtx decodes the body of a security-context extension (what
// follows its 8-byte header) holding nr contexts: nil for none. Every size
// is checked against the body; the one context must fill it exactly (its
// padding aside), its name be NUL-terminated, at most XATTR_NAME_MAX bytes
// and in the security namespace (what LSMs label with), its label at most
// XATTR_SIZE_MAX bytes. Anything else is EINVAL, and so is more than one
// context, which would leave the server to pick among labels.
func parseSecCtx(body []byte, nr uint32) (*SecCtx, syscall.Errno) {
	switch {
	case nr == 0:
		if len(body) != 0 {
			return nil, syscall.EINVAL
		}
		return nil, 0
	case nr != 1 || len(body) < secCtxHdrSize || len(body) > secCtxBodyMax:
		return nil, syscall.EINVAL
	}
	size := uint64(binary.LittleEndian.Uint32(body))
	rest := body[secCtxHdrSize:]
	nul := bytes.IndexByte(rest, 0)
	if nul < 0 || nul > xattrNameMax {
		return nil, syscall.EINVAL
	}
	name := rest[:nul]
	if len(name) <= len(securityPrefix) || !bytes.HasPrefix(name, []byte(securityPrefix)) {
		return nil, syscall.EINVAL
	}
	rest = rest[nul+1:]
	if size > xattrSizeMax || size > uint64(len(rest)) {
		return nil, syscall.EINVAL
	}
	// The entry is padded to 8 bytes and is the whole body.
	if used := secCtxHdrSize + uint64(nul) + 1 + size; (used+7)&^7 != uint64(len(body)) {
		return nil, syscall.EINVAL
	}
	return &SecCtx{Name: name, Value: rest[:size]}, 0
}

// secCtxExt reads a security-context extension of type typ (its count)
// whose body is n bytes at in's cursor into q.secctx: only in a session
// that negotiated SECURITY_CTX, once per request.
func (q *Queue) secCtxExt(in *bufvec.Vec, typ uint32, n int) syscall.Errno {
	ss := q.s.sess.Load()
	if typ > maxSecCtxType || ss == nil || ss.caps&gofuse.CAP_SECURITY_CTX == 0 || q.secSeen || n > secCtxBodyMax {
		return syscall.EINVAL
	}
	q.secSeen = true
	if cap(q.secBuf) < n {
		q.secBuf = make([]byte, n)
	}
	body := q.secBuf[:n]
	if err := in.ReadFull(body); err != nil {
		return argErr(err)
	}
	sc, errno := parseSecCtx(body, typ)
	if errno != 0 {
		return errno
	}
	if sc != nil {
		q.secBody = *sc
		q.secctx = &q.secBody
	}
	return 0
}
