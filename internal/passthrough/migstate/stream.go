package migstate

import (
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"unicode/utf8"
)

// The migration stream: ONE stream for both kinds of destination, a Rust
// virtiofsd 1.13 and this daemon.
//
//	stream  = message [trailer]
//	message = the Rust daemon's PassthroughFs, postcard-encoded
//	          (postcard.go), V2 when we write it
//	trailer = ours: what the message cannot carry
//
// The Rust loader reads the pipe to its end and decodes the message with
// postcard::from_bytes, which ignores what follows: it loads our streams
// and never sees the trailer. We read the message, then the trailer if any
// bytes follow; a stream without one comes from the Rust daemon (see
// internal/fuse/state.go for how the FUSE session is then rebuilt).
//
// Ownership: this package writes and reads the whole stream (Encode,
// Decode); internal/passthrough builds the file system's records from its
// tables (SaveState) and reopens them (LoadState). The FUSE server
// (internal/fuse) owns the session record, which it hands to SaveState and
// gets back from LoadState as opaque bytes: the trailer carries it, this
// package does not read it. That is the whole interface between the FUSE
// layer and the file system (fuse.MigratableFileSystem).
//
// The message (the Rust serialized.rs, 1.13; enum variant indexes as
// varints, fields in order):
//
//	PassthroughFs = 0 V1 | 1 V2
//	V1  = inodes: Vec<Inode>, next_inode: u64, handles: Vec<Handle>,
//	      next_handle: u64, negotiated_opts: {writeback, announce_submounts,
//	      posix_acl, sup_group_extension: bool}
//	V2  = V1, mount_paths: HashMap<u64 mount id, String path in the share>
//	Inode = id: u64, refcount: u64, location: InodeLocation,
//	        file_handle: Option<FileHandle>
//	InodeLocation = 0 RootNode | 1 Path{parent: u64, filename: String} |
//	        2 Invalid | 3 FullPath{filename: String} |
//	        4 FileHandle{handle: FileHandle}
//	FileHandle = mnt_id: u64, handle_type: i32, handle: Vec<u8>
//	Handle = id: u64, inode: u64, source: 0 OpenInode{flags: i32}
//
// What internal/passthrough's SaveState writes there: V2; the root as
// RootNode (refcount 2, the Rust daemon's own, plus one per Path child);
// every other inode the guest holds with refcount = its lookup count, as
// FullPath{path below the share}, or with --migration-verify-handles as
// Path{parent: 1, filename: that path} (the 1.13 loader compares file
// handles for Path, not for FullPath; the root's refcount then counts those
// children), as FileHandle in file-handles mode, or Invalid when the source
// has no way to it; mount_paths only in file-handles mode; next_inode and
// next_handle above every id in use. Handles as OpenInode with the flags the
// Rust daemon records (O_DIRECTORY for OPENDIR, no O_APPEND).
//
// The trailer, integers little-endian:
//
//	magic     8 bytes  "GVFSTAIL"
//	version   u32      1
//	session   u32 length ≤ maxSessionRecord, then the FUSE server's
//	          session record
//	ninodes   u32      = the message's inode count
//	ninodes × (in the message's order)
//	    type     u32   S_IFMT bits (0: unknown)
//	    pathlen  u16   ≤ MaxPath: a path the message could not carry
//	    path     pathlen bytes (not UTF-8: the message says Invalid)
//	nhandles  u32      = the message's handle count
//	nhandles × (in the message's order)
//	    kind     u8    0 file, 1 directory
//	    flags    u32   our host open flags (no O_CREAT, O_EXCL, O_TRUNC,
//	                   O_CLOEXEC)
//	crc       u32      CRC-32C (Castagnoli) of every byte before it, the
//	                   message's included
//	end of stream
//
// The decoder checks every count and length against its bound before
// allocating for it, refuses a stream beyond its size limit, bytes after
// the message that are not a trailer, a trailer of another version, one
// that does not match the message, a checksum mismatch, and anything after
// the trailer. The checksum catches a corrupted or mis-framed stream (a
// bug, a wrong pipe), not an attacker: the state comes from the VMM.

const (
	trailerMagic   = "GVFSTAIL"
	trailerVersion = 1

	// PassthroughFs variants.
	stateV1 = 0
	stateV2 = 1
	// HandleSource::OpenInode.
	sourceOpenInode = 0
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// errTooLarge is returned for a stream beyond the size limit.
var errTooLarge = errors.New("migration state too large")

// Encode writes s: the message, then (s.Ours) the trailer. It refuses
// records a decoder would refuse, so a source never sends a state no
// destination can read.
func Encode(w io.Writer, s *State) error {
	if err := s.encodable(); err != nil {
		return fmt.Errorf("encode migration state: %w", err)
	}
	return EncodeUnchecked(w, s)
}

// EncodeUnchecked writes s as it is, records Encode would refuse included:
// for tests of what a loader refuses. A source uses Encode.
func EncodeUnchecked(w io.Writer, s *State) error {
	e := newPCWriter(w)
	e.message(s)
	if s.Ours {
		e.trailer(s)
	}
	if err := e.flush(); err != nil {
		return fmt.Errorf("write migration state: %w", err)
	}
	return nil
}

// encodable checks what Encode needs of s.
func (s *State) encodable() error {
	if len(s.Inodes) > maxInodes || len(s.Handles) > maxHandles || len(s.MountPaths) > maxMounts ||
		len(s.Session) > maxSessionRecord {
		return fmt.Errorf("%d inodes, %d handles, %d mounts, session of %d bytes",
			len(s.Inodes), len(s.Handles), len(s.MountPaths), len(s.Session))
	}
	for k := range s.Inodes {
		if err := s.Inodes[k].encodable(); err != nil {
			return fmt.Errorf("node %#x: %w", s.Inodes[k].ID, err)
		}
	}
	if !s.V2 && len(s.MountPaths) > 0 {
		return fmt.Errorf("mount paths in V1")
	}
	for _, m := range s.MountPaths {
		if checkMountPath(m.Path) != nil || !utf8.ValidString(m.Path) {
			return fmt.Errorf("mount %d: bad path %q", m.MountID, m.Path)
		}
	}
	return nil
}

// encodable checks what the message needs of a record.
func (r *Inode) encodable() error {
	switch r.Loc {
	case LocPath, LocFullPath:
		if !utf8.ValidString(r.Path) || CheckPath(r.Path) != nil {
			return fmt.Errorf("bad path %q", r.Path)
		}
	case LocFileHandle:
		if err := r.Handle.check(); err != nil {
			return err
		}
	case LocRoot, LocInvalid:
	default:
		return fmt.Errorf("location kind %d", r.Loc)
	}
	if r.Verify != nil {
		if err := r.Verify.check(); err != nil {
			return err
		}
	}
	if len(r.RawPath) > MaxPath {
		return fmt.Errorf("path of %d bytes", len(r.RawPath))
	}
	return nil
}

// message writes the Rust PassthroughFs.
func (e *pcWriter) message(s *State) {
	if s.V2 {
		e.u32(stateV2)
	} else {
		e.u32(stateV1)
	}
	e.u64(uint64(len(s.Inodes)))
	for k := range s.Inodes {
		e.inode(&s.Inodes[k])
	}
	e.u64(s.NextInode)
	e.u64(uint64(len(s.Handles)))
	for k := range s.Handles {
		h := &s.Handles[k]
		e.u64(h.ID)
		e.u64(h.Inode)
		e.u32(sourceOpenInode)
		e.i32(h.Flags)
	}
	e.u64(s.NextHandle)
	e.boolean(s.Opts.Writeback)
	e.boolean(s.Opts.AnnounceSubmounts)
	e.boolean(s.Opts.PosixACL)
	e.boolean(s.Opts.SuppGroups)
	if s.V2 {
		e.u64(uint64(len(s.MountPaths)))
		for _, m := range s.MountPaths {
			e.u64(m.MountID)
			e.str(m.Path)
		}
	}
}

func (e *pcWriter) inode(r *Inode) {
	e.u64(r.ID)
	e.u64(r.Refcount)
	e.u32(uint32(r.Loc))
	switch r.Loc {
	case LocPath:
		e.u64(r.Parent)
		e.str(r.Path)
	case LocFullPath:
		e.str(r.Path)
	case LocFileHandle:
		e.fileHandle(&r.Handle)
	}
	e.boolean(r.Verify != nil)
	if r.Verify != nil {
		e.fileHandle(r.Verify)
	}
}

func (e *pcWriter) fileHandle(h *FileHandle) {
	e.u64(h.MountID)
	e.i32(h.Type)
	e.bytes(h.Bytes)
}

// trailer writes our trailer, its checksum last.
func (e *pcWriter) trailer(s *State) {
	e.raw([]byte(trailerMagic))
	e.le32(trailerVersion)
	e.le32(uint32(len(s.Session)))
	e.raw(s.Session)
	e.le32(uint32(len(s.Inodes)))
	for k := range s.Inodes {
		r := &s.Inodes[k]
		e.le32(r.Type)
		e.le16(uint16(len(r.RawPath)))
		e.raw([]byte(r.RawPath))
	}
	e.le32(uint32(len(s.Handles)))
	for k := range s.Handles {
		h := &s.Handles[k]
		var kind uint8
		if h.Dir {
			kind = 1
		}
		e.u8(kind)
		e.le32(h.HostFlags)
	}
	e.le32(e.crc)
}

// Decode reads a whole stream from r, to its end, reading at most limit
// bytes (MaxSize for a loader). The records it returns are not validated:
// see Validate.
func Decode(r io.Reader, limit int64) (*State, error) {
	d := newPCReader(r, limit)
	s, err := d.message()
	if err != nil {
		return nil, fmt.Errorf("migration state: %w", err)
	}
	if eof, err := d.atEOF(); err != nil || eof {
		return s, err
	}
	if err := d.trailer(s); err != nil {
		return nil, fmt.Errorf("migration state: %w", err)
	}
	return s, nil
}

// message decodes the Rust PassthroughFs.
func (d *pcReader) message() (*State, error) {
	s := &State{}
	switch v := d.u32("the version"); {
	case d.err != nil:
		return nil, d.err
	case v == stateV2:
		s.V2 = true
	case v != stateV1:
		return nil, fmt.Errorf("not a virtiofsd migration state (version variant %d; V1 is 0, V2 is 1)", v)
	}
	var err error
	if s.Inodes, err = d.inodes(); err != nil {
		return nil, err
	}
	s.NextInode = d.u64("next_inode")
	if s.Handles, err = d.handles(); err != nil {
		return nil, err
	}
	s.NextHandle = d.u64("next_handle")
	s.Opts = Negotiated{
		Writeback:         d.boolean("negotiated_opts"),
		AnnounceSubmounts: d.boolean("negotiated_opts"),
		PosixACL:          d.boolean("negotiated_opts"),
		SuppGroups:        d.boolean("negotiated_opts"),
	}
	if s.V2 {
		n := d.count(maxMounts, "the mount path count")
		s.MountPaths = make([]MountPath, 0, min(n, 64))
		for k := 0; k < n && d.err == nil; k++ {
			s.MountPaths = append(s.MountPaths, MountPath{MountID: d.u64("a mount path"), Path: d.str(MaxPath, "a mount path")})
		}
	}
	if d.err != nil {
		return nil, d.err
	}
	return s, nil
}

// inodes decodes the message's Vec<Inode>. A read error stays in d.err
// (the caller checks it at the end); a value no variant has is returned.
func (d *pcReader) inodes() ([]Inode, error) {
	n := d.count(maxInodes, "the inode count")
	// Grow with what the stream really holds, not with what it claims.
	inodes := make([]Inode, 0, min(n, 4096))
	for k := 0; k < n && d.err == nil; k++ {
		r := Inode{ID: d.u64("an inode"), Refcount: d.u64("an inode"), Loc: Loc(d.u32("an inode location"))}
		switch r.Loc {
		case LocRoot, LocInvalid:
		case LocPath:
			r.Parent = d.u64("a path location")
			r.Path = d.str(MaxPath, "a path location")
		case LocFullPath:
			r.Path = d.str(MaxPath, "a full path location")
		case LocFileHandle:
			r.Handle = d.fileHandle("a file handle location")
		default:
			if d.err == nil {
				return nil, fmt.Errorf("inode %d: unknown location variant %d", k, r.Loc)
			}
		}
		if d.option("an inode's file handle") {
			h := d.fileHandle("an inode's file handle")
			r.Verify = &h
		}
		inodes = append(inodes, r)
	}
	return inodes, nil
}

func (d *pcReader) fileHandle(what string) FileHandle {
	return FileHandle{
		MountID: d.u64(what),
		Type:    d.i32(what),
		Bytes:   d.bytes(maxHandleBytes, what),
	}
}

// handles decodes the message's Vec<Handle>, as inodes does.
func (d *pcReader) handles() ([]Handle, error) {
	n := d.count(maxHandles, "the handle count")
	handles := make([]Handle, 0, min(n, 4096))
	for k := 0; k < n && d.err == nil; k++ {
		h := Handle{ID: d.u64("a handle"), Inode: d.u64("a handle")}
		if src := d.u32("a handle source"); d.err == nil && src != sourceOpenInode {
			return nil, fmt.Errorf("handle %d: unknown source variant %d", k, src)
		}
		h.Flags = d.i32("a handle's flags")
		handles = append(handles, h)
	}
	return handles, nil
}

// trailer decodes our trailer into s, to the end of the stream. As in
// message, a read error stays in d.err until the checksum is read.
func (d *pcReader) trailer(s *State) error {
	if err := d.trailerHead(s); err != nil {
		return err
	}
	if err := d.trailerInodes(s); err != nil {
		return err
	}
	if err := d.trailerHandles(s); err != nil {
		return err
	}
	sum := d.crc
	got := d.le32("the checksum")
	if d.err != nil {
		return d.err
	}
	if got != sum {
		return fmt.Errorf("checksum %#08x, computed %#08x", got, sum)
	}
	// Nothing may follow (a longer stream is another format, or two).
	switch eof, err := d.atEOF(); {
	case err != nil:
		return err
	case !eof:
		return fmt.Errorf("bytes after the trailer (at byte %d)", d.n)
	}
	s.Ours = true
	return nil
}

// trailerHead reads the magic, the version and the session record.
func (d *pcReader) trailerHead(s *State) error {
	end := d.n
	var magic [len(trailerMagic)]byte
	k, _ := io.ReadFull(d.r, magic[:])
	d.crc = crc32.Update(d.crc, castagnoli, magic[:k])
	d.n += int64(k)
	switch {
	case string(magic[:k]) != trailerMagic[:k]:
		return fmt.Errorf("the bytes after the %d-byte message are not a govirtiofsd trailer (they start %q)", end, magic[:k])
	case k < len(magic):
		return fmt.Errorf("the trailer (after %d bytes): %w", d.n, errTruncated)
	}
	if v := d.le32("the trailer version"); d.err == nil && v != trailerVersion {
		return fmt.Errorf("trailer version %d is not supported (this daemon reads %d)", v, trailerVersion)
	}
	if n := d.le32("the session record"); d.err == nil {
		if n > maxSessionRecord {
			return fmt.Errorf("session record of %d bytes (max %d)", n, maxSessionRecord)
		}
		s.Session = make([]byte, n)
		d.read(s.Session, "the session record")
	}
	return nil
}

// trailerInodes reads each inode's type and the path the message could not
// carry.
func (d *pcReader) trailerInodes(s *State) error {
	if n := d.le32("the trailer's inode count"); d.err == nil && int(n) != len(s.Inodes) {
		return fmt.Errorf("the trailer describes %d inodes, the message has %d", n, len(s.Inodes))
	}
	var path [MaxPath]byte
	for k := 0; k < len(s.Inodes) && d.err == nil; k++ {
		r := &s.Inodes[k]
		r.Type = d.le32("the trailer's inodes")
		n := d.le16("the trailer's inodes")
		if d.err != nil {
			break
		}
		if n > MaxPath {
			return fmt.Errorf("trailer: node %#x: path of %d bytes (max %d)", r.ID, n, MaxPath)
		}
		d.read(path[:n], "the trailer's inodes")
		r.RawPath = string(path[:n])
	}
	return nil
}

// trailerHandles reads each handle's kind and host open flags.
func (d *pcReader) trailerHandles(s *State) error {
	if n := d.le32("the trailer's handle count"); d.err == nil && int(n) != len(s.Handles) {
		return fmt.Errorf("the trailer describes %d handles, the message has %d", n, len(s.Handles))
	}
	for k := 0; k < len(s.Handles) && d.err == nil; k++ {
		h := &s.Handles[k]
		kind := d.u8("the trailer's handles")
		h.HostFlags = d.le32("the trailer's handles")
		if d.err == nil && kind > 1 {
			return fmt.Errorf("trailer: handle %#x: kind %d", h.ID, kind)
		}
		h.Known, h.Dir = true, kind == 1
	}
	return nil
}
