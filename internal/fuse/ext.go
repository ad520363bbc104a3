package fuse

import (
	"encoding/binary"
	"syscall"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// Request extensions (protocol 7.38): the last total_extlen*8 bytes of a
// request, after its arguments and names, are a sequence of
//
//	fuse_ext_header { u32 size; u32 type }   size counts the header, a multiple of 8
//	then size-8 bytes of the extension
//
// Linux sends one only with creation requests (CREATE, MKNOD, MKDIR,
// SYMLINK, TMPFILE): FUSE_EXT_GROUPS (type 32) when CREATE_SUPP_GROUP is
// negotiated and the caller may write to the parent directory only through
// a supplementary group, { u32 nr_groups; u32 groups[nr_groups] } (Linux
// sends nr_groups 1, the parent directory's group; other clients, and the
// Rust virtiofsd 1.14, allow several: up to MaxGroups are accepted); a
// security context (types 0..31, their count: secctx.go) with
// SECURITY_CTX, refused in a session that did not negotiate it.
const (
	extHeaderSize = 8
	extGroups     = 32
)

// MaxGroups bounds the supplementary groups one request may carry: the
// credentials switch sets them all on a thread (setgroups), and a bound
// keeps that, and the copy, small. A request with more is EINVAL.
const MaxGroups = 32

// extensions checks the extension area of the request in q.req, records the
// supplementary groups in q.groups, and cuts the area off in, so that the
// argument decoders see the request as without extensions. An area that is
// malformed or holds an extension type this server does not know is EINVAL:
// an unknown extension may change the request's meaning.
func (q *Queue) extensions(in *bufvec.Vec) syscall.Errno {
	end := in.Size()
	n := int(q.req.TotalExtlen) * 8
	if n > end-InHeaderSize {
		return syscall.EINVAL
	}
	start := end - n
	if err := in.Seek(start); err != nil {
		return argErr(err)
	}
	q.secSeen = false
	var b [16]byte
	for pos := start; pos < end; {
		if err := in.ReadFull(b[:extHeaderSize]); err != nil {
			return argErr(err)
		}
		size := int(binary.LittleEndian.Uint32(b[0:]))
		typ := binary.LittleEndian.Uint32(b[4:])
		if size < extHeaderSize || size%8 != 0 || size > end-pos {
			return syscall.EINVAL
		}
		switch typ {
		case extGroups:
			// One FUSE_EXT_GROUPS at most: a second would leave us to
			// guess which list the permission came through.
			if size < extHeaderSize+8 || q.groups != nil {
				return syscall.EINVAL
			}
			if err := in.ReadFull(b[8:12]); err != nil {
				return argErr(err)
			}
			nr := binary.LittleEndian.Uint32(b[8:])
			if nr == 0 || nr > MaxGroups || uint64(size) < extHeaderSize+4+4*uint64(nr) {
				return syscall.EINVAL
			}
			gs := q.groupBuf[:nr]
			for i := range gs {
				if err := in.ReadFull(b[12:16]); err != nil {
					return argErr(err)
				}
				if gs[i] = binary.LittleEndian.Uint32(b[12:]); gs[i] == NoGroup {
					return syscall.EINVAL
				}
			}
			q.groups = gs
		default:
			if errno := q.secCtxExt(in, typ, size-extHeaderSize); errno != 0 {
				return errno
			}
		}
		pos += size
		if err := in.Seek(pos); err != nil {
			return argErr(err)
		}
	}
	if in.Seek(InHeaderSize) != nil || in.Truncate(start) != nil {
		return syscall.EINVAL
	}
	return 0
}
