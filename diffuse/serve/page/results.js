// Results a person can see: a tiny picture or video is drawn larger at a whole-number scale with its pixels kept
// sharp (a 16-pixel image as 16 crisp squares a side, not a blur), its real size said beside; a video plays and
// downloads; a sound plays and downloads. Each result is a <figure> in #gen-result, newest first.
"use strict";

const SHOW_MAX_HEIGHT_PX = 256;  // a small result is drawn up to this tall...
const SHOW_MAX_WIDTH_PX = 640;  // ...and this wide (a spritesheet of frames is wide and short)

// The whole-number scale a w x h result is drawn at within `room` pixels of width (1: large enough as it is).
function displayScale(w, h, room) {
  if (!(w > 0 && h > 0)) return 1;
  return Math.max(1, Math.floor(Math.min(Math.min(SHOW_MAX_WIDTH_PX, room || Infinity) / w, SHOW_MAX_HEIGHT_PX / h)));
}

// Draws `el` (an img or video of w x h pixels) at its display scale; returns its real size in words.
function drawSized(el, w, h) {
  const k = displayScale(w, h, $("gen-result").clientWidth);
  el.style.width = w * k + "px";
  el.style.height = h * k + "px";
  el.dataset.scale = k;
  el.classList.toggle("upscaled", k > 1);
  return `${w} × ${h} px` + (k > 1 ? `, shown ${k}× larger` : "");
}

// A figure holding `media`, with a caption (its real size, filled in once known) and a download link.
function resultFigure(media, href, filename, kind) {
  const fig = document.createElement("figure");
  fig.className = "result " + kind;
  const caption = document.createElement("figcaption");
  const size = document.createElement("span");
  size.className = "real-size";
  const link = document.createElement("a");
  link.className = "download";
  link.href = href;
  link.download = filename;
  link.textContent = "download";
  caption.append(size, " ", link);
  fig.append(media, caption);
  $("gen-result").prepend(fig);
  return size;
}

function showPicture(src, alt, filename = "diffuse-image.png") {
  const img = document.createElement("img");
  img.className = "picture";
  img.alt = alt;
  const size = resultFigure(img, src, filename, "image");
  img.addEventListener("load", () => { size.textContent = drawSized(img, img.naturalWidth, img.naturalHeight); });
  img.src = src;
  return img;
}

function showVideo(src, alt, filename = "diffuse-video.mp4") {
  const video = document.createElement("video");
  video.className = "movie";
  video.title = alt;
  Object.assign(video, { controls: true, loop: true, muted: true, autoplay: true, playsInline: true });
  const size = resultFigure(video, src, filename, "video");
  video.addEventListener("loadedmetadata", () => {
    size.textContent = drawSized(video, video.videoWidth, video.videoHeight) + `, ${video.duration.toFixed(2)} s`;
  });
  video.addEventListener("error", () => { size.textContent = "this browser cannot play it: download it"; });
  video.src = src;
  return video;
}

function showSound(src, alt, filename = "diffuse-sound.wav") {
  const audio = document.createElement("audio");
  audio.className = "sound";
  audio.title = alt;
  audio.controls = true;
  const size = resultFigure(audio, src, filename, "audio");
  audio.addEventListener("loadedmetadata", () => { size.textContent = `${audio.duration.toFixed(2)} s of sound`; });
  audio.addEventListener("error", () => { size.textContent = "this browser cannot play it: download it"; });
  audio.src = src;
  return audio;
}
